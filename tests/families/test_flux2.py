"""FLUX.2 [klein] (tiny-flux2-klein) and [dev] (tiny-flux2): the env is the pipeline's own (the text
encoder's chat template, three hidden states side by side, 4-D position ids, [dev]'s embedded
guidance), the schedule shifts with the image tokens and the step count, an ODE rollout reaches the
pipeline's own final latents and images ([klein] with its CFG on and off), SP=2 matches SP=1, a LoRA
on FLUX.2's modules changes the rollouts as the trainer replays them, and a model without CFG (a
step-distilled [klein]) refuses a CFG scale. Server info and replay parity (each sampler, [klein]'s CFG on
and off, bf16 latents) are test_contract.py's, with the other families."""

import json
import os
import shutil

import grpc
import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from peft import get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from support.adapters import joint_attention_tokens
from support.errors import field_violations
from support.families import FAMILIES, family_request
from support.parity import TOLERANCE, assert_replays, assert_same_numbers
from support.requests import split_events
from support.servers import start_server
from support.weights import next_version, with_lora

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient
from rollout_server import families
from rollout_server.errors import InvalidRequest
from rollout_server.families.base import MediaShape
from rollout_server.families.flux2.adapter import stacked_text_layers
from rollout_server.limits import Limits
from rollout_server.validation import ServingContext, resolve

KLEIN, DEV = "flux2-klein", "flux2"
BOTH = [KLEIN, DEV]
SHAPE = MediaShape(frames=1, height=64, width=64)
GRID = 64 // 16  # 8x VAE, 2x2 patches: 4 x 4 tokens
TOKENS = GRID * GRID
TEXT_TOKENS = 64  # the presets' tokenizers' model_max_length: every prompt is padded to it
TEXT_LAYERS = (0, 1, 2)  # the presets' two-layer text encoders: their embeddings and both layers
U = 2.0**-24  # float32 unit roundoff


@pytest.fixture(scope="module")
def family() -> str:
    """The family of the tests that are [klein]'s alone (the others are parametrized over both)."""
    return KLEIN


@pytest.mark.parametrize("family", BOTH)
def test_the_stacked_text_layers_are_the_pipelines_where_the_encoder_has_them(adapter, family):
    """Layers 9, 18 and 27 of [klein]'s 36-layer Qwen3 and 10, 20 and 30 of [dev]'s 40-layer Mistral;
    a shallower encoder's last three hidden states, which for the presets make the text width."""
    assert stacked_text_layers(36, (9, 18, 27)) == stacked_text_layers(27, (9, 18, 27)) == (9, 18, 27)
    assert stacked_text_layers(40, (10, 20, 30)) == (10, 20, 30)
    assert adapter.text_encoder_out_layers == TEXT_LAYERS
    assert stacked_text_layers(2, adapter.pipeline_text_layers) == TEXT_LAYERS
    text_width = adapter.pipe.text_encoder.config.get_text_config().hidden_size
    assert adapter.transformer.config.joint_attention_dim == len(TEXT_LAYERS) * text_width


def chat_turn(family: str, pipe, prompt: str) -> str:
    """The text the family's pipeline encodes for ``prompt``, by its tokenizer's chat template, checked
    against the template written out: Qwen3's user turn with thinking off, or Mistral's system
    prompt (the pipeline's system message) and instruction."""
    if family == KLEIN:
        turn = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        messages = [{"role": "user", "content": prompt}]
        rendered = pipe.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    else:
        turn = f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]{prompt}[/INST]"
        messages = [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
            {"role": "user", "content": [{"type": "text", "text": prompt}]},
        ]
        rendered = pipe.tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == turn
    return turn


@pytest.mark.parametrize("family", BOTH)
@torch.no_grad()  # as the pipeline encodes
def test_env_is_the_pipelines_own(adapter, family_pipeline, family):
    """encode_prompt's embedding and text ids and prepare_latents' image ids, bitwise; and the
    independent formula: the chat turn padded to the text length, the hidden states of the encoder
    side by side on the channels; ids (0, 0, 0, position) for the text and (0, row, column, 0) for
    the image tokens; the guidance scale for [dev], none for [klein]."""
    pipe, prompt = family_pipeline, FAMILIES[family].prompts[0]
    env = adapter.encode_text(prompt, 3.5, SHAPE)
    assert set(env) == FAMILIES[family].env_keys
    embeds, txt_ids = pipe.encode_prompt(
        prompt=prompt, max_sequence_length=TEXT_TOKENS, text_encoder_out_layers=TEXT_LAYERS
    )
    assert torch.equal(env["encoder_hidden_states"], embeds) and torch.equal(env["txt_ids"], txt_ids)
    noise = torch.zeros(1, 16, GRID, GRID)  # the latents on their grid: only their shape makes the ids
    _, latent_ids = pipe.prepare_latents(1, 4, 64, 64, torch.float32, torch.device("cpu"), None, noise)
    assert torch.equal(env["img_ids"], latent_ids)

    turn = chat_turn(family, pipe, prompt)
    tokens = pipe.tokenizer(
        turn, padding="max_length", max_length=TEXT_TOKENS, add_special_tokens=False, return_tensors="pt"
    )
    states = pipe.text_encoder(**tokens, output_hidden_states=True).hidden_states
    assert len(states) == len(TEXT_LAYERS)
    assert torch.equal(env["encoder_hidden_states"], torch.cat(states, dim=-1))  # copies: bitwise
    assert env["txt_ids"].tolist() == [[[0, 0, 0, position] for position in range(TEXT_TOKENS)]]
    assert env["img_ids"].tolist() == [[[0, row, col, 0] for row in range(GRID) for col in range(GRID)]]
    if family == DEV:
        assert torch.equal(env["guidance"], torch.tensor([3.5]))  # the scale encode_text was given
    else:
        assert env["guidance"] is None
    assert (env["joint_attention_kwargs"], env["return_dict"]) == (None, False)
    unseen = "Zebra café ☕ at 3am!"  # every byte is in the vocabulary
    assert pipe.tokenizer.decode(pipe.tokenizer(unseen, add_special_tokens=False).input_ids) == unseen


@pytest.mark.parametrize("steps", [4, 10])
def test_the_shift_follows_the_image_tokens_and_the_step_count(adapter, steps):
    """The sigmas are linspace(1, 1/T, T) under the exponential time shift by the empirical mu of the
    image tokens and the step count, against float64. The scheduler computes in float32: t rounds
    (u), 1/t (2u) then 1/t - 1 cancels by up to 1/(1 - t) = T (2Tu + u), and the shift's sum and
    division add a few u more, damped by the shift: (2T + 5) u relative."""
    sigmas, timesteps = adapter.schedule(steps, SHAPE)
    mu = compute_empirical_mu(TOKENS, steps)
    t = np.linspace(1.0, 1 / steps, steps)
    shifted = np.exp(mu) / (np.exp(mu) + (1 / t - 1))
    np.testing.assert_allclose(sigmas[:-1].double().numpy(), shifted, rtol=(2 * steps + 5) * U, atol=0)
    assert sigmas[-1] == 0 and torch.equal(timesteps[:-1], sigmas[:-1] * 1000)
    assert compute_empirical_mu(TOKENS, 4) != compute_empirical_mu(TOKENS, 10)  # the steps move it


def pipeline_run(pipe, prompts, x0: torch.Tensor, guidance_scale: float):
    """The FLUX.2 pipeline's own final latents (packed tokens) and images from the packed ``x0``, at the
    request's size and the preset's text length and layers."""
    latents = []

    def record_latents(pipe, step, timestep, tensors):
        latents.append(tensors["latents"])
        return {}

    # The pipeline takes its latents on their grid and packs them row-major into tokens.
    on_grid = x0.transpose(1, 2).reshape(len(prompts), -1, GRID, GRID)
    images = pipe(
        prompt=list(prompts),
        height=SHAPE.height,
        width=SHAPE.width,
        num_inference_steps=4,
        guidance_scale=guidance_scale,
        latents=on_grid,
        max_sequence_length=TEXT_TOKENS,
        text_encoder_out_layers=TEXT_LAYERS,
        callback_on_step_end=record_latents,
    ).images
    return latents[-1], images


@pytest.mark.parametrize(
    ("family", "scale"),
    [(KLEIN, 1.0), (KLEIN, 4.0), (DEV, 3.5)],
    ids=["klein-no-cfg", "klein-cfg", "dev-guidance"],
)
def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline, family, scale):
    """Over gRPC, [klein] with its pipeline's CFG (guidance_scale 4 against its empty negative prompt)
    or without, [dev] with its embedded guidance: from the same x_0 the pipeline's own loop, whose
    sigmas are the stream's bitwise, reaches the streamed final latents, and decodes them through
    the VAE's batch-norm statistics to the streamed images."""
    request = family_request(
        family, "ODE", cfg=False, samples_per_prompt=1, images=True, guidance_scale=scale
    )
    trajectories = family_client.rollout(request)
    cfg = family == KLEIN and scale > 1
    assert trajectories[0].transformer_call.guidance_rule == ("true_cfg" if cfg else "none")
    pipe = family_pipeline
    bn = pipe.vae.bn
    assert not torch.equal(bn.running_mean, torch.zeros(16)) and not torch.equal(
        bn.running_var, torch.ones(16)
    )
    x0 = torch.stack([t.latents[0] for t in trajectories])
    final, images = pipeline_run(pipe, request.prompts, x0, scale)
    np.testing.assert_array_equal(trajectories[0].sigmas.numpy(), pipe.scheduler.sigmas.numpy())
    # [klein]'s pipeline runs each branch's 2 rows in one forward, the server all 4 rows together:
    # batch rounding (TOLERANCE), which CFG at s = 4 multiplies by up to 2s - 1 = 7.
    tolerance = (2 * scale - 1) * TOLERANCE if cfg else TOLERANCE
    streamed = torch.stack([t.latents[-1] for t in trajectories])
    torch.testing.assert_close(streamed, final, atol=tolerance, rtol=0)
    for trajectory, image in zip(trajectories, images, strict=True):
        assert trajectory.image().size == (SHAPE.width, SHAPE.height)
        diff = np.asarray(trajectory.image(), dtype=int) - np.asarray(image, dtype=int)
        assert np.abs(diff).max() <= 1  # uint8 rounding of nearly equal latents


def test_forward_activation_counts_what_the_blocks_run_over(adapter):
    """Measured on a real forward: the first block's joint attention runs over the 16 image and the
    64 padded text tokens, and the widest per-token activation is a single-stream block's fused
    projection (q, k, v and the SwiGLU's two halves of mlp_ratio x the width); a text's env holds
    text_elements."""
    env = adapter.encode_text("a fox", 4.0, SHAPE)
    widths = []
    projection = adapter.transformer.single_transformer_blocks[0].attn.to_qkv_mlp_proj
    handle = projection.register_forward_hook(lambda module, args, output: widths.append(output.shape[-1]))
    try:
        tokens = joint_attention_tokens(adapter, env, SHAPE)
    finally:
        handle.remove()
    assert (tokens, widths[0]) == adapter.forward_activation(SHAPE) == (TOKENS + TEXT_TOKENS, 9 * 32)
    assert env["encoder_hidden_states"].numel() == adapter.text_elements()


@pytest.fixture(scope="module")
def sp2_client(family_resources, cache_dir, tmp_path_factory):
    """The family's server at --sp 2, of its own (the LoRA test changes its policy): one per family,
    started on first use."""
    servers, clients = {}, {}

    def client(family: str) -> RolloutClient:
        if family not in clients:
            family_resources.folder(family)  # built here first, not by the server
            log = tmp_path_factory.mktemp(family) / "sp2.log"
            servers[family] = start_server(cache_dir, log, "--model", FAMILIES[family].preset, "--sp", "2")
            clients[family] = RolloutClient(servers[family].address, timeout=300)
        return clients[family]

    yield client
    for opened in clients.values():
        opened.close()
    for server in servers.values():
        assert server.stop() == 0


def family_cfg(family: str) -> bool:
    """CFG on where the family has it."""
    return True in FAMILIES[family].replay_cfg


@pytest.mark.parametrize("family", BOTH)
def test_sp2_matches_sp1(family_client, family_transformer, sp2_client, family):
    """At SP=2 the ranks split the 16 image tokens and the 64 text tokens (the plan cuts
    encoder_hidden_states and txt_ids too) and gather the image's back: noise and log-probs bitwise
    as at SP=1, latents and velocities within TOLERANCE ([klein] with CFG), and the stream replays
    through a plain transformer."""
    debug = [rollout_pb2.DEBUG_TENSOR_EPS, rollout_pb2.DEBUG_TENSOR_VELOCITY]
    request = family_request(family, "FLOW_SDE", cfg=family_cfg(family), debug_tensors=debug)
    runs = {
        1: split_events(family_client.stream(request)),
        2: split_events(sp2_client(family).stream(request)),
    }
    assert runs[2].started.message.sp_degree == 2
    assert_same_numbers(runs[1], runs[2], bitwise_log_probs=True)
    assert_replays(family_transformer, runs[2].trajectories())


def test_a_shape_the_ranks_cannot_split_is_refused(sp2_client):
    """48 x 80 pixels are 3 x 5 = 15 image tokens, which 2 ranks cannot split evenly: INVALID_ARGUMENT
    naming height, before any work."""
    request = family_request(KLEIN, "ODE", cfg=False, height=48, width=80)
    with pytest.raises(grpc.RpcError) as refused:
        sp2_client(KLEIN).rollout(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [violation.field for violation in field_violations(refused.value)] == ["height"]
    assert "15 tokens" in refused.value.details()


@pytest.mark.parametrize("family", BOTH)
def test_a_lora_on_flux2_modules_changes_the_rollouts_as_the_trainer_replays_them(
    family_client, family_transformer, sp2_client, family
):
    """The server's default LoRA targets (GetServerInfo) on every rank of the SP=2 server. The split
    gathers proj_out's output, so an adapter on it is INVALID_ARGUMENT there; without it, the adapter
    binds to the modules PEFT wraps in the trainer's copy (the single-stream blocks' fused projections
    among them) and changes the rollouts, which replay through the adapted transformer and not the
    base; a full update with the base's weights then drops it."""
    client = sp2_client(family)
    request = family_request(family, "FLOW_SDE", cfg=family_cfg(family))
    base = family_client.rollout(request)
    version = next_version(client)
    targets = list(client.server_info().lora_targets)
    adapted, config = with_lora(family_transformer, trained=True, targets=targets)
    with pytest.raises(grpc.RpcError) as refused:
        client.update_weights(get_peft_model_state_dict(adapted), version, lora_config=config)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [violation.field for violation in field_violations(refused.value)] == ["header.lora_config_json"]
    assert "['proj_out']" in refused.value.details()

    split_targets = [target for target in targets if target != "proj_out"]
    adapted, config = with_lora(family_transformer, trained=True, targets=split_targets)
    client.update_weights(get_peft_model_state_dict(adapted), version, lora_config=config)
    wrapped = sorted(name for name, module in adapted.named_modules() if isinstance(module, BaseTunerLayer))
    assert list(client.server_info().lora_adapter.modules) == wrapped
    single = {name.split(".", 2)[-1] for name in wrapped if name.startswith("single_")}
    assert single == {"attn.to_qkv_mlp_proj"}
    assert {"transformer_blocks.0.ff.linear_in", "x_embedder"} <= set(wrapped)

    pushed = client.rollout(request)
    assert {t.policy_version for t in pushed} == {version}
    changed = min((p.latents[-1] - b.latents[-1]).abs().max() for p, b in zip(pushed, base, strict=True))
    assert changed > 1e-3, "the adapter must change every sample"
    assert_replays(adapted, pushed, bare_reference=True)
    with pytest.raises(AssertionError):
        assert_replays(family_transformer, pushed)  # the base alone does not replay them

    client.update_weights(family_transformer.state_dict(), version + 1)
    assert not client.server_info().HasField("lora_adapter")
    for restored, original in zip(client.rollout(request), base, strict=True):
        # SP=2 against SP=1 on the same weights: the split's rounding (test_sp2_matches_sp1).
        torch.testing.assert_close(restored.latents, original.latents, atol=TOLERANCE, rtol=0)


def test_a_distilled_klein_runs_without_cfg(family_folder, tmp_path):
    """A step-distilled [klein] (``is_distilled`` in its model_index.json, as the released 4B and 9B):
    4 steps and no CFG by default; a guidance_scale, which its pipeline would ignore, and a negative
    prompt are INVALID_ARGUMENT naming them; the default scale is accepted."""
    folder = tmp_path / "distilled"
    shutil.copytree(family_folder, folder, copy_function=os.symlink)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").unlink()  # a link to the preset's own
    (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    adapter = families.load(folder, torch.device("cpu"), torch.float32)
    assert adapter.pipe.config.is_distilled and adapter.scale_fields == ()
    defaults = adapter.defaults()
    assert (defaults.num_steps, defaults.guidance_scale) == (4, 1.0)
    serving = ServingContext.of(adapter, defaults, Limits())
    assert not serving.has_cfg  # GetServerInfo states no CFG field, and the rule "none"
    for field, value in (("guidance_scale", 4.0), ("negative_prompt", "blurry")):
        with pytest.raises(InvalidRequest) as raised:
            resolve(rollout_pb2.RolloutRequest(prompts=["a fox"], **{field: value}), serving)
        ((named, why),) = raised.value.violations
        assert named == field and "without CFG" in why
    resolved = resolve(rollout_pb2.RolloutRequest(prompts=["a fox"], guidance_scale=1.0), serving)
    assert (resolved.guidance_scale, resolved.num_steps) == (1.0, 4)
