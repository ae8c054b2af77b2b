"""Model family detection from a diffusers folder, and the start-up errors around it."""

import json

import pytest
from support.servers import command_line_exit

from rollout_server import errors, families
from rollout_server.families.cosmos3 import Cosmos3Adapter
from rollout_server.families.flux import FluxAdapter, FluxKontextAdapter
from rollout_server.families.flux2 import Flux2Adapter, Flux2KleinAdapter
from rollout_server.families.hunyuan_video15 import HunyuanVideo15Adapter
from rollout_server.families.qwen_image import QwenImageAdapter, QwenImageEditAdapter
from rollout_server.families.sd3 import SD3Adapter
from rollout_server.families.wan_i2v import WanImageToVideoAdapter
from rollout_server.families.z_image import ZImageAdapter


@pytest.mark.parametrize(
    ("family", "adapter"),
    [
        ("flux", FluxAdapter),
        ("sd3", SD3Adapter),
        ("qwen-image", QwenImageAdapter),
        ("flux-kontext", FluxKontextAdapter),
        ("flux2-klein", Flux2KleinAdapter),
        ("flux2", Flux2Adapter),
        ("qwen-image-edit", QwenImageEditAdapter),
        ("wan-i2v", WanImageToVideoAdapter),
        ("z-image", ZImageAdapter),
        ("hunyuan-video15", HunyuanVideo15Adapter),
        ("cosmos3", Cosmos3Adapter),
    ],
)
def test_preset_folder_is_detected(family_folder, family, adapter):
    detected = families.detect(family_folder)
    assert detected is adapter and detected.family == family


def test_unsupported_pipeline_class_is_named(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(errors.UnsupportedModel, match="KandinskyPipeline"):
        families.detect(tmp_path)


@pytest.mark.parametrize(
    "model_index, expected",
    [
        ({"_class_name": "StableCascadePriorPipeline"}, "StableCascadePriorPipeline"),
        (None, "model_index.json"),
    ],
    ids=["unsupported-class", "not-a-pipeline-folder"],
)
def test_server_refuses_to_start_with_a_clear_message(tmp_path, model_index, expected):
    if model_index is not None:
        (tmp_path / "model_index.json").write_text(json.dumps(model_index))
    message = command_line_exit("serve", "--model", str(tmp_path), "--port", "0")
    assert message.startswith("rollout-server: cannot load model") and expected in message
    assert "\n" not in message
