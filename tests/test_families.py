"""Model family detection from a diffusers folder, and the start-up errors around it."""

import json

import pytest
from support.families import FAMILIES
from support.servers import command_line_exit

from rollout_server import errors, families
from rollout_server.families import registry
from rollout_server.presets import resolve_model

# Every preset of the registry, but small-flux (tiny-flux's builder, larger).
PRESETS = [name for name in registry.presets() if name != "small-flux"]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_folder_is_detected(cache_dir, preset):
    """Each preset's folder is detected as its family's adapter of the pipeline class the builder saved,
    which the family's spec declares."""
    if missing := next((f.missing for f in FAMILIES.values() if f.preset == preset), ""):
        pytest.skip(missing)
    family, _ = registry.presets()[preset]
    folder = resolve_model(preset, cache_dir)
    pipeline_class = json.loads((folder / "model_index.json").read_text())["_class_name"]
    assert pipeline_class in family.adapters
    detected = families.detect(folder)
    assert detected is registry.adapter_class(pipeline_class)
    assert detected.__name__ == family.adapters[pipeline_class]
    assert detected.pipeline_type.__name__ == pipeline_class


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
