"""The shapes model's building blocks: a Flux-family folder pads prompts to its own tokenizer's text
length, and examples/pretrain_shapes.py trains its VAE and transformer (both losses fall) and writes
weights that load into the pipeline it started from."""

import json

import torch
from safetensors.torch import load_file
from support.servers import run_example

from rollout_server import families
from rollout_server.families.flux.shapes import TEXT_TOKENS, untrained_shapes_pipeline


def test_a_flux_folder_pads_prompts_to_its_own_text_length(tmp_path, tiny_flux_folder):
    untrained_shapes_pipeline(tmp_path).save_pretrained(tmp_path)
    shape = families.base.MediaShape(1, 64, 64)
    shapes_adapter = families.load(tmp_path, torch.device("cpu"), torch.float32)
    env = shapes_adapter.encode_text("a red circle", 1.0, shape)
    assert env["encoder_hidden_states"].shape[1] == TEXT_TOKENS
    assert env["guidance"] is None  # no guidance embedding: nothing to feed it
    flux_adapter = families.load(tiny_flux_folder, torch.device("cpu"), torch.float32)
    assert flux_adapter.encode_text("a red circle", 3.5, shape)["encoder_hidden_states"].shape[1] == 512


def test_pretraining_lowers_both_losses_and_writes_loadable_weights(tmp_path):
    run_example(
        "pretrain_shapes",
        *("--out", tmp_path, "--threads", "1", "--eval-steps", "0"),
        *("--vae-steps", "20", "--vae-batch", "4", "--steps", "20", "--batch", "8"),
    )
    weights = tmp_path / "weights"
    record = json.loads((weights / "PRETRAINED.json").read_text())
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    for losses in (state["vae_losses"], state["losses"]):
        assert len(losses) == 20
        assert sum(losses[-5:]) < sum(losses[:5])
    pipe = untrained_shapes_pipeline(tmp_path / "again")
    for name in ("vae", "transformer"):
        getattr(pipe, name).load_state_dict(load_file(weights / f"{name}.safetensors"), strict=True)
    assert set(record["sha256"]) == {"vae.safetensors", "transformer.safetensors"}
    assert json.loads((weights / "latents.json").read_text()).keys() == {"shift_factor", "scaling_factor"}
