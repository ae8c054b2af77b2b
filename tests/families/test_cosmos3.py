"""Cosmos3 text-to-video on the tiny-cosmos3 preset: the server's schedule (the pipeline's UniPC,
Karras sigmas on flow sigmas), env (the prompt's token ids with the pipeline's templates, the negative
prompt's with the inverse ones, and the packed sequence's indexes and mRoPE ids), transformer call (one
packed sample per call, a float32 timestep per noisy vision token), CFG, UniPC steps and decoding are
Cosmos3OmniPipeline's own; a text's tokens are bounded
once tokenised; --sp splits over Ulysses (the transformer's seams and our processor), never ring
attention. Server info, replay parity, frame bounds (4k + 1) and SP=2 against SP=1 are the
contract's (test_contract.py), with the other families."""

import httpx
import numpy as np
import pytest
import torch
from support.adapters import forward_at
from support.errors import refused_rollout
from support.families import FAMILIES, family_request
from support.parity import TOLERANCE
from support.servers import http_url

from rollout_core.transformer_call import TransformerCall
from rollout_server.errors import ParallelismUnsupported
from rollout_server.families.base import MediaShape
from rollout_server.families.cosmos3.adapter import TEXT_TOKENS
from rollout_server.parallel import ParallelDims, check_splittable
from rollout_server.prompt_cache import PromptCache

SPEC = FAMILIES["cosmos3"]
SHAPE = MediaShape(5, 64, 64)


@pytest.fixture
def family() -> str:
    return "cosmos3"


@pytest.mark.parametrize("cfg", [True, False])
def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline, family_resources, cfg):
    """Schedule (the pipeline's UniPC set_timesteps: Karras flow sigmas, integer timesteps), env (the
    token ids with the templates, the negative prompt's with the inverse templates), the call (one
    packed sample, the raw timestep per noisy vision token), CFG and the UniPC steps all as
    Cosmos3OmniPipeline: from the same x_0, its own ``__call__`` (one sample per call) reaches each
    streamed final latent. Both call the transformer on one sample per forward with the same inputs,
    in two processes: Batch and split rounding (docs/testing.md), TOLERANCE in v, times up to
    2s - 1 = 11 at scale 6 with CFG; the UniPC steps are diffusers' float32 arithmetic against
    rollout_core's, the same operations."""
    request = family_request("cosmos3", "ODE", cfg=cfg, samples_per_prompt=1)
    trajectories = family_client.rollout(request)
    pipe = family_pipeline
    pipe.scheduler.set_timesteps(4)
    np.testing.assert_array_equal(trajectories[0].sigmas.numpy(), pipe.scheduler.sigmas.numpy())
    np.testing.assert_array_equal(
        trajectories[0].timesteps[:-1].numpy(), pipe.scheduler.timesteps.float().numpy()
    )
    adapter = family_resources.adapter("cosmos3")
    for trajectory in trajectories:
        assert trajectory.transformer_call.form == adapter.call_form
        call = trajectory.transformer_call
        assert TransformerCall.from_json(call.to_json()) == call  # field 20 survives a saved file
        final = pipe(
            prompt=request.prompts[trajectory.prompt_index],
            negative_prompt=request.negative_prompt if cfg else None,
            latents=trajectory.latents[:1],
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=request.guidance_scale,
            output_type="latent",
        ).video
        # Batch and split rounding (the docstring): TOLERANCE in v, times up to 2s - 1 with CFG.
        bound = (2 * request.guidance_scale - 1) * TOLERANCE if cfg else TOLERANCE
        torch.testing.assert_close(final[0], trajectory.latents[-1], atol=bound, rtol=bound)


def test_the_negative_prompt_takes_the_inverse_templates(family_resources):
    """The pipeline appends "The video is not ..." to the negative prompt: the env of a text as the
    negative prompt is not its env as a prompt, and the prompt cache keeps the two apart."""
    adapter = family_resources.adapter("cosmos3")
    cache = PromptCache(adapter, max_entries=8)
    text = SPEC.prompts[0]
    encoded = cache.encode([text], text, 6.0, SHAPE)
    positive, negative = (encoded.conditioning.envs[branch][0] for branch in ("positive", "negative"))
    assert encoded.misses == 2 and len(cache) == 2
    cond, uncond = adapter.pipe.tokenize_prompt(text, text, num_frames=5, height=64, width=64)
    assert positive["input_ids"][0].tolist() == cond and negative["input_ids"][0].tolist() == uncond
    rendered = adapter.pipe.text_tokenizer.decode(uncond)
    assert "The video is not 0.2 seconds long" in rendered and "not of 64x64 resolution" in rendered
    # Only the text's tokens differ: the vision grid's shapes are the request's.
    assert positive["vision_token_shapes"] == negative["vision_token_shapes"] == [[2, 2, 2]]


def test_each_sample_streams_its_frames_as_the_pipeline_decodes_them(family_client, family_pipeline):
    trajectories = family_client.rollout(
        family_request("cosmos3", "FLOW_SDE", cfg=False, images=True, num_frames=9)
    )
    pipe = family_pipeline
    for trajectory in trajectories:
        latents = trajectory.latents[-1:]
        assert latents.shape[2] == 3  # 9 frames: 3 latent frames
        # The pipeline's decode: the VAE's normalisation undone, vae.decode, its video processor.
        mean = pipe._vae_latents_mean.view(1, -1, 1, 1, 1)
        inv_std = pipe._vae_latents_inv_std.view(1, -1, 1, 1, 1)
        with torch.no_grad():
            video = pipe.vae.decode(latents / inv_std + mean).sample
        expected = pipe.video_processor.postprocess_video(video, output_type="np")[0]  # [F, H, W, 3]
        frames = trajectory.frames()
        assert len(frames) == 9 and all(frame.size == (64, 64) for frame in frames)
        got = np.stack([np.asarray(frame.convert("RGB"), dtype=np.float64) for frame in frames])
        # Decoded in two processes: pixels apart by float32 rounding, far below half an 8-bit step, so
        # a value rounds to the same byte or, on a rounding boundary, to the next.
        np.testing.assert_allclose(got, np.round(expected * 255), atol=1)


def test_sp_splits_over_ulysses_where_both_head_counts_divide(adapter, family_resources):
    """The adapter's seams and processor take a Ulysses split when the query heads (4) and the
    key/value heads (2) both divide by its degree: 2 ranks, not 4; ring attention, which the
    processor's exchange is not written for, is refused at start-up naming the split to use. A
    transformer loaded without the adapter has no seams: refused as having no plan."""
    check_splittable(adapter.transformer, ParallelDims(sp=2, world_size=2))
    with pytest.raises(
        ParallelismUnsupported, match="has 2 key/value heads: not divisible by the Ulysses degree 4"
    ):
        check_splittable(adapter.transformer, ParallelDims(sp=4, world_size=4))
    for split in ("ring", "ulysses+ring"):
        with pytest.raises(
            ParallelismUnsupported, match="runs on Ulysses alone: use --attention-split ulysses"
        ):
            check_splittable(adapter.transformer, ParallelDims(sp=4, attention_split=split, world_size=4))
    with pytest.raises(ParallelismUnsupported, match="Cosmos3OmniTransformer has no context-parallel plan"):
        check_splittable(family_resources.transformer("cosmos3"), ParallelDims(sp=2, world_size=2))


def test_generated_tokens_are_the_vision_tokens_the_seams_split(adapter):
    """A real forward at an odd patch grid (48 x 80 pixels: 3 x 5 latent rows and columns, padded to
    2 x 3 patches; 3 latent frames): the vision pathway the shard seam cuts, and its rotary
    embeddings, have generated_tokens(shape) tokens, which validation checks against the ranks."""
    shape = MediaShape(9, 48, 80)
    transformer = adapter.transformer
    shard, seen = transformer._cp_shard_fn, []

    def capture(und_seq, gen_seq, rotary_emb):
        seen.append((gen_seq.shape[0], rotary_emb[2].shape[0]))
        return shard(und_seq, gen_seq, rotary_emb)

    transformer._cp_shard_fn = capture
    try:
        forward_at(adapter, SPEC.prompts[0], shape)
    finally:
        transformer._cp_shard_fn = shard
    assert seen == [(adapter.generated_tokens(shape),) * 2] == [(3 * 2 * 3,) * 2]


# 4096 characters, the server's limit (--max-prompt-chars), of a fox emoji: 4 UTF-8 bytes, and as many
# tokens (the byte-level BPE merges none of them), 16,384 tokens, 4 times the env's TEXT_TOKENS.
EMOJI_TEXT = "\U0001f98a" * 4096
ONE_STEP = {"prompts": ["a red fox"], "samples_per_prompt": 1, "num_steps": 1}


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"prompts": [EMOJI_TEXT]}, "prompts[0]"), ({"negative_prompt": EMOJI_TEXT}, "negative_prompt")],
    ids=["prompt", "negative"],
)
def test_a_text_is_bounded_by_its_tokens_not_its_characters(family_client, adapter, fields, field):
    """A text within the character limit whose tokens are above TEXT_TOKENS (what the memory estimate
    sizes a text's env and a forward's text by; the pipeline truncates nothing) is refused once
    tokenised, INVALID_ARGUMENT naming its field, before any step: a prompt and the negative prompt
    (encoded with the inverse templates) alike. A prompt within the bound runs."""
    tokens = len(adapter.pipe.tokenize_prompt(EMOJI_TEXT, EMOJI_TEXT)[0])
    assert tokens > 4 * TEXT_TOKENS
    request = family_request("cosmos3", "ODE", cfg=True, **{**ONE_STEP, **fields})
    violations = refused_rollout(family_client, request)
    assert [violation.field for violation in violations] == [field]
    assert f"above the {TEXT_TOKENS} this model takes" in violations[0].description
    within = family_request("cosmos3", "ODE", cfg=True, **ONE_STEP, negative_prompt="fox " * 1000)
    assert len(family_client.rollout(within)) == 1


def test_the_http_front_end_answers_400(family_resources):
    """The same bound over SGLang's API: 400 (the answer was 2.5 times its own size bound before),
    naming the prompt as SGLang's request does (``prompt``)."""
    url = http_url(family_resources.server("cosmos3"))
    body = {"prompt": EMOJI_TEXT, "num_inference_steps": 1, "width": 64, "height": 64}
    answer = httpx.post(f"{url}/rollout/generate", json=body, timeout=300)
    assert answer.status_code == 400, answer.text
    detail, violations = answer.json()["detail"], answer.json()["violations"]
    assert "prompt: " in detail and f"above the {TEXT_TOKENS} this model takes" in detail
    assert [v["field"] for v in violations] == ["prompt"], violations
