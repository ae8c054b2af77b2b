"""Z-Image on the tiny-z-image preset: the transformer call (per-sample latents with a frame axis,
(1000 - t) / 1000 in float32, the negated prediction) is the pipeline's own, bitwise; the env holds
each prompt's own caption length; CFG runs above a scale of 0; a rollout steps as ZImagePipeline's
own loop does; our context-parallel plan splits each stack on two gloo ranks. Server info, replay parity
(FLOW_SDE, DANCE, CPS; CFG on and off; bf16 latents), SP=2 (the split of the image, the caption and
the unified sequence) and a LoRA update are in test_contract.py with the other families."""

import copy
import datetime
import os
import socket
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.errors import field_violations
from support.families import FAMILIES, LONG_PROMPT, SHORT_PROMPT, family_request
from support.parity import TOLERANCE
from support.requests import split_events
from support.servers import metrics_url, scrape

from rollout_client import replay_log_probs
from rollout_core.transformer_call import call_transformer, stack_envs
from rollout_server import families
from rollout_server.families.base import MediaShape
from rollout_server.families.z_image.adapter import SPLIT_STACKS, padded
from rollout_server.parallel import ParallelDims, SequenceParallel

SPEC = FAMILIES["z-image"]
SHAPE = MediaShape(frames=1, height=64, width=64)
IMAGE_TOKENS = (64 // 16) ** 2  # 8x VAE, 2x2 patches: 16, which the transformer pads to 32


@pytest.fixture
def family() -> str:
    return "z-image"


def caption_tokens(pipe, text: str) -> int:
    """The tokens ZImagePipeline keeps of ``text``: its chat template, unpadded."""
    messages = [{"role": "user", "content": text}]
    templated = pipe.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    return len(pipe.tokenizer(templated).input_ids)


def test_the_tokenizer_renders_qwen3s_chat_template(family_pipeline):
    """With thinking enabled, Qwen3's template wraps the prompt in a user turn and opens the
    assistant's, and its markers are single tokens, as in Qwen3's vocabulary."""
    tokenizer = family_pipeline.tokenizer
    messages = [{"role": "user", "content": SHORT_PROMPT}]
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert rendered == f"<|im_start|>user\n{SHORT_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    no_thinking = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_thinking == rendered + "<think>\n\n</think>\n\n"
    for marker in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tokenizer(marker).input_ids) == 1, marker


@torch.no_grad()
def test_env_and_call_are_the_pipelines_own(adapter, family_pipeline):
    """A text's env is ZImagePipeline.encode_prompt's embedding at the text's own length, and the call
    rule with it is the pipeline's transformer call bitwise (the same modules on the same tensors):
    (1000 - t) / 1000 in float32 for each t of the schedule, latents [C, 1, H/8, W/8] per sample,
    the list of caption embeddings, the prediction negated."""
    pipe = family_pipeline
    envs = [adapter.encode_text(text, 4.0, SHAPE) for text in (LONG_PROMPT, LONG_PROMPT)]
    (embeds,), _ = pipe.encode_prompt(prompt=LONG_PROMPT, do_classifier_free_guidance=False)
    assert set(envs[0]) == SPEC.env_keys and envs[0]["return_dict"] is False
    assert torch.equal(envs[0]["cap_feats"], embeds.unsqueeze(0))
    assert embeds.shape == (caption_tokens(pipe, LONG_PROMPT), pipe.transformer.config.cap_feat_dim)

    env = stack_envs(envs, adapter.batched_env_keys)
    x = torch.randn(2, *adapter.latent_shape(SHAPE), generator=torch.Generator().manual_seed(0))
    assert x.shape[1:] == SPEC.latent_shape
    _, timesteps = adapter.schedule(4, SHAPE)
    assert timesteps[0] == 1000.0  # where (t - 1000) / -1000 would give -0.0, not the pipeline's +0.0
    for t in timesteps[:-1]:
        v = call_transformer(
            adapter.transformer,
            x,
            t,
            env,
            torch.float32,
            adapter.timestep_divisor,
            adapter.conditioning,
            adapter.call_form,
            adapter.batched_env_keys,
        )
        # ZImagePipeline.__call__'s loop body without CFG.
        timestep = (1000 - t.expand(2)) / 1000
        inputs = list(x.unsqueeze(2).unbind(dim=0))
        out = pipe.transformer(inputs, timestep, [embeds, embeds], return_dict=False)[0]
        expected = -torch.stack([o.float() for o in out], dim=0).squeeze(2)
        assert torch.equal(v, expected), float(t)


def test_the_schedule_is_the_pipelines_with_its_shift(adapter):
    """get_default_z_image_sigmas and the shift as ZImagePipeline sets them up: the preset's static
    shift of 3, and with a dynamically shifting scheduler mu from the 16 image tokens (before the
    transformer pads them)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import (
        calculate_shift,
        get_default_z_image_sigmas,
        retrieve_timesteps,
    )

    preset = adapter.pipe.scheduler
    dynamic = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    for scheduler in (preset, dynamic):
        adapter.pipe.scheduler = scheduler
        try:
            sigmas, timesteps = adapter.schedule(4, SHAPE)
        finally:
            adapter.pipe.scheduler = preset
        # ZImagePipeline.__call__'s steps 5.
        config = scheduler.config
        mu = calculate_shift(
            IMAGE_TOKENS,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        own = copy.deepcopy(scheduler)
        expected, _ = retrieve_timesteps(own, 4, "cpu", sigmas=get_default_z_image_sigmas(4), mu=mu)
        assert torch.equal(timesteps[:-1], expected) and timesteps[-1] == 0
        assert torch.equal(sigmas, own.sigmas)
    assert not torch.equal(adapter.schedule(4, SHAPE)[0], sigmas)  # the shift rule matters


def test_each_sample_has_its_own_prompts_caption(
    family_resources, family_client, family_pipeline, family_transformer
):
    """Two prompts of different lengths, two samples each, with CFG: each sample's env holds its own
    prompt's caption, unpadded, and the negative prompt's; another prompt's env does not replay it.
    Rows of one caption length share a forward, the others run apart: each step runs 3 forwards,
    2 + 2 positive rows and 4 negative ones."""
    pipe = family_pipeline
    request = family_request("z-image", "FLOW_SDE", cfg=True, num_steps=2)
    url = metrics_url(family_resources.server("z-image"))
    before = scrape(url)
    trajectories = family_client.rollout(request)
    after = scrape(url)
    moved = {
        name: after[key] - before.get(key, 0.0)
        for name in ("count", "sum")
        if (key := (f"rollout_server_rows_per_forward_{name}", ())) in after
    }
    assert moved == {"count": 2 * 3, "sum": 2 * 8}
    lengths = [caption_tokens(pipe, text) for text in SPEC.prompts]
    negative = caption_tokens(pipe, SPEC.cfg_on["negative_prompt"])
    assert len({*lengths, negative}) == 3
    width = family_transformer.config.cap_feat_dim
    for trajectory in trajectories:
        assert trajectory.env["positive"]["cap_feats"].shape == (1, lengths[trajectory.prompt_index], width)
        assert trajectory.env["negative"]["cap_feats"].shape == (1, negative, width)
    other = trajectories[0]
    other.env = trajectories[2].env
    replayed = replay_log_probs(family_transformer, other)
    assert (replayed - other.log_probs).nan_to_num().abs().max() > TOLERANCE


def test_cfg_runs_above_a_scale_of_zero(family_client):
    """As in ZImagePipeline, guidance_scale > 0 turns CFG on (0.5 guides too, unlike the families whose
    scale is off up to 1) and 0 leaves the positive branch alone; a negative prompt without CFG is
    INVALID_ARGUMENT naming it, with the bound (true_cfg_scale, which Z-Image does not read, is
    test_errors.py's)."""

    def started(**fields):
        request = family_request("z-image", "ODE", cfg=False, num_steps=2, manifest_only=True, **fields)
        return split_events(family_client.stream(request)).started.message

    call = started(guidance_scale=0.5, negative_prompt="blurry").transformer_call
    assert (call.guidance_rule, call.guidance_rule_scale, list(call.branches)) == (
        "cfg_from_positive",
        0.5,
        ["positive", "negative"],
    )
    assert started().transformer_call.guidance_rule == "none"
    with pytest.raises(grpc.RpcError) as raised:
        started(negative_prompt="blurry")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (violation,) = field_violations(raised.value)
    assert (violation.field, violation.description) == (
        "negative_prompt",
        "is only used with guidance_scale > 0",
    )


def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline):
    """Schedule, env, the call rule and CFG around the positive branch all as ZImagePipeline: from the
    same x_0 its own loop reaches the streamed final latents and images. The pipeline runs both CFG
    branches of both prompts in one forward (padded to the longest caption, the attention masked),
    the server each caption length apart: Batch and split rounding (docs/testing.md), 1e-5 in v,
    times up to 2s + 1 = 9 through the CFG of scale 4, is 1e-4 on the latents."""
    request = family_request("z-image", "ODE", cfg=True, samples_per_prompt=1, images=True)
    trajectories = family_client.rollout(request)
    pipe = family_pipeline
    latents = []

    def record_latents(pipe, step, timestep, tensors):
        latents.append(tensors["latents"])
        return {}

    images = pipe(
        prompt=list(request.prompts),
        negative_prompt=[request.negative_prompt] * len(request.prompts),
        guidance_scale=request.guidance_scale,
        latents=torch.stack([t.latents[0] for t in trajectories]),
        height=64,
        width=64,
        num_inference_steps=4,
        callback_on_step_end=record_latents,
    ).images
    np.testing.assert_array_equal(trajectories[0].sigmas.numpy(), pipe.scheduler.sigmas.numpy())
    np.testing.assert_array_equal(trajectories[0].timesteps[:-1].numpy(), pipe.scheduler.timesteps.numpy())
    streamed = torch.stack([t.latents[-1] for t in trajectories])
    torch.testing.assert_close(latents[-1], streamed, atol=1e-4, rtol=1e-4)
    for trajectory, image in zip(trajectories, images, strict=True):
        assert trajectory.image().size == (64, 64)
        diff = np.asarray(trajectory.image(), dtype=int) - np.asarray(image, dtype=int)
        assert np.abs(diff).max() <= 1  # uint8 rounding of nearly equal latents


def split_on_rank(rank: int, port: int, folder: str, results) -> None:
    """One of two gloo ranks: a forward of the unsplit transformer, then of the split one, recording
    each block's output length."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        adapter = families.load(Path(folder), torch.device("cpu"), torch.float32)
        env = adapter.encode_text(LONG_PROMPT, 4.0, SHAPE)
        x = torch.randn(1, *adapter.latent_shape(SHAPE), generator=torch.Generator().manual_seed(0))

        def velocity() -> torch.Tensor:
            with torch.no_grad():
                return call_transformer(
                    adapter.transformer,
                    x,
                    500.0,
                    env,
                    torch.float32,
                    adapter.timestep_divisor,
                    adapter.conditioning,
                    adapter.call_form,
                    adapter.batched_env_keys,
                )

        whole = velocity()
        dims = ParallelDims(sp=2, world_size=2)
        SequenceParallel(dims, rank=rank, mesh=dims.build_mesh("cpu")).split_transformer(adapter.transformer)
        lengths = {}
        for stack in SPLIT_STACKS:
            for index, block in enumerate(getattr(adapter.transformer, stack)):
                key = (stack, index)
                block.register_forward_hook(
                    lambda m, args, out, key=key: lengths.__setitem__(key, out.shape[1])
                )
        split = velocity()
        results.put((rank, env["cap_feats"].shape[1], lengths, float((split - whole).abs().max())))
    finally:
        dist.destroy_process_group()


def test_two_ranks_split_each_stack_and_gather_it_back(family_folder):
    """Our context-parallel plan on two gloo ranks: the first block of each stack runs on half its
    sequence (the image's 16 patches padded to 32, the caption padded to a multiple of 32, and the
    unified sequence of both), the last gives the whole sequence back, and the velocity is the unsplit
    one within TOLERANCE (Batch and split rounding, docs/testing.md)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("forkserver")  # the test servers' fork server: its imports are done
    results = context.Queue()
    processes = [
        context.Process(target=split_on_rank, args=(rank, port, str(family_folder), results))
        for rank in (0, 1)
    ]
    for process in processes:
        process.start()
    reports = sorted(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    for _, caption_length, lengths, difference in reports:
        image, caption = padded(IMAGE_TOKENS), padded(caption_length)
        assert image == 32 and caption % 32 == 0
        whole = {"noise_refiner": image, "context_refiner": caption, "layers": image + caption}
        blocks = {stack: max(index for s, index in lengths if s == stack) + 1 for stack in SPLIT_STACKS}
        for (stack, index), length in lengths.items():
            last = index == blocks[stack] - 1
            assert length == (whole[stack] if last else whole[stack] // 2), (stack, index)
        assert difference <= TOLERANCE
