"""Model families: detect a diffusers folder's family from its ``model_index.json`` and load it."""

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollout_server.errors import UnsupportedModel
from rollout_server.families.cosmos3 import Cosmos3Adapter
from rollout_server.families.flux import FluxAdapter, FluxKontextAdapter
from rollout_server.families.flux2 import Flux2Adapter, Flux2KleinAdapter
from rollout_server.families.hunyuan_video15 import HunyuanVideo15Adapter
from rollout_server.families.ltx2 import LTX2Adapter
from rollout_server.families.qwen_image import QwenImageAdapter, QwenImageEditAdapter
from rollout_server.families.sd3 import SD3Adapter
from rollout_server.families.wan import WanAdapter
from rollout_server.families.wan_i2v import WanImageToVideoAdapter
from rollout_server.families.z_image import ZImageAdapter

if TYPE_CHECKING:
    from rollout_server.families.base import FamilyAdapter

ADAPTERS: dict[str, type["FamilyAdapter"]] = {
    adapter.pipeline_type.__name__: adapter
    for adapter in (
        FluxAdapter,
        FluxKontextAdapter,
        Flux2Adapter,
        Flux2KleinAdapter,
        SD3Adapter,
        QwenImageAdapter,
        QwenImageEditAdapter,
        WanAdapter,
        WanImageToVideoAdapter,
        HunyuanVideo15Adapter,
        LTX2Adapter,
        Cosmos3Adapter,
        ZImageAdapter,
    )
}


def detect(folder: Path) -> type["FamilyAdapter"]:
    """The adapter class for the pipeline named in ``folder/model_index.json``."""
    index = Path(folder) / "model_index.json"
    pipeline_class = json.loads(index.read_text()).get("_class_name")
    if pipeline_class not in ADAPTERS:
        supported = ", ".join(sorted(ADAPTERS))
        raise UnsupportedModel(
            f"{index}: pipeline class {pipeline_class!r} is not supported (supported: {supported})"
        )
    return ADAPTERS[pipeline_class]


def load(folder: Path, device: torch.device, dtype: torch.dtype) -> "FamilyAdapter":
    return detect(folder).from_folder(folder, device, dtype)
