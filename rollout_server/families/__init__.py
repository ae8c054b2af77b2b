"""Model families: detect a diffusers folder's family from its ``model_index.json`` and load it.

Each family is a folder here, listed once in ``registry.py``. Importing this package or a family's
spec loads no model library; an adapter module is imported when a folder of its pipeline is detected.
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_server.errors import UnsupportedModel
from rollout_server.families import registry

if TYPE_CHECKING:
    import torch

    from rollout_server.families.base import FamilyAdapter


def detect(folder: Path) -> type["FamilyAdapter"]:
    """The adapter class for the pipeline named in ``folder/model_index.json``."""
    index = Path(folder) / "model_index.json"
    pipeline_class = json.loads(index.read_text()).get("_class_name")
    if pipeline_class not in registry.pipeline_classes():
        supported = ", ".join(sorted(registry.pipeline_classes()))
        raise UnsupportedModel(
            f"{index}: pipeline class {pipeline_class!r} is not supported (supported: {supported})"
        )
    return registry.adapter_class(pipeline_class)


def load(folder: Path, device: "torch.device", dtype: "torch.dtype") -> "FamilyAdapter":
    return detect(folder).from_folder(folder, device, dtype)
