"""HunyuanVideo 1.5 text-to-video on the tiny-hunyuan-video15 preset: the server's schedule, env
(both text encoders, the zero image embeddings and conditioning channels), transformer call, CFG and
decoding are HunyuanVideo15Pipeline's own; a guider the
server cannot serve is refused; --sp splits over Ulysses (our plan), never ring attention; the blocks
attend as diffusers' processor does without its S x S masks, and what grows with the square of a
sequence is what the memory estimate counts. Server info, replay parity, frame bounds (4k + 1) and
SP=2 against SP=1 are in test_contract.py, with the other families."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import (
    extract_glyph_texts,
    retrieve_timesteps,
)
from support.adapters import forward_at
from support.families import family_request
from support.parity import TOLERANCE
from torch.overrides import TorchFunctionMode

from rollout_core.transformer_call import apply_guidance
from rollout_server.errors import ParallelismUnsupported, UnsupportedModel
from rollout_server.families.base import MediaShape
from rollout_server.families.hunyuan_video15.adapter import HunyuanVideo15Adapter, UlyssesAttnProcessor
from rollout_server.live_tensors import LiveTensorBytes
from rollout_server.parallel import ParallelDims, check_splittable


@pytest.fixture
def family() -> str:
    return "hunyuan-video15"


def test_the_system_turn_is_the_108_tokens_the_pipeline_crops(family_pipeline):
    """The tiny tokenizer renders the chat template with the pipeline's system message, and that turn
    is exactly the prompt_template_encode_start_idx tokens the pipeline drops, as with Qwen2.5-VL's."""
    pipe = family_pipeline
    system = [{"role": "system", "content": pipe.system_message}]
    turn = pipe.tokenizer.apply_chat_template(system, tokenize=False)
    assert turn == f"<|im_start|>system\n{pipe.system_message}<|im_end|>\n"
    assert len(pipe.tokenizer(turn).input_ids) == pipe.prompt_template_encode_start_idx == 108


@pytest.mark.parametrize("cfg", [True, False])
def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline, cfg):
    """Schedule (linspace(1, 0, N + 1)[:-1] shifted by the scheduler), the two text encodings with
    their masks, the zero conditioning channels and image embeddings, the raw timestep and CFG all as
    HunyuanVideo15Pipeline: from the same x_0, its own ``__call__`` (its guider at the request's scale)
    reaches the streamed final latents. Both run each branch's two rows in one forward of their own,
    in two processes: Batch and split rounding (docs/testing.md), TOLERANCE in v, times up to
    2s - 1 = 11 at scale 6 with CFG."""
    request = family_request("hunyuan-video15", "ODE", cfg=cfg, samples_per_prompt=1)
    trajectories = family_client.rollout(request)
    pipe = family_pipeline
    retrieve_timesteps(pipe.scheduler, 4, sigmas=np.linspace(1.0, 0.0, 5)[:-1])
    np.testing.assert_array_equal(trajectories[0].sigmas.numpy(), pipe.scheduler.sigmas.numpy())
    np.testing.assert_array_equal(trajectories[0].timesteps[:-1].numpy(), pipe.scheduler.timesteps.numpy())
    # Only the second prompt quotes text: its glyph text's bytes (and ByT5's </s>) reach ByT5; the
    # first prompt's mask is zero.
    glyphs = [t.env["positive"]["encoder_attention_mask_2"].sum().item() for t in trajectories]
    glyph_text = extract_glyph_texts(request.prompts[1])
    assert glyphs == [0, len(pipe.tokenizer_2(glyph_text).input_ids)] and "open" in glyph_text
    guider = pipe.guider
    pipe.guider = ClassifierFreeGuidance(guidance_scale=request.guidance_scale)
    try:
        final = pipe(
            prompt=list(request.prompts),
            # One negative prompt per prompt: the pipeline does not broadcast a single one.
            negative_prompt=[request.negative_prompt] * len(request.prompts) if cfg else None,
            latents=torch.stack([t.latents[0] for t in trajectories]),
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            output_type="latent",
        ).frames
    finally:
        pipe.guider = guider
    bound = (2 * request.guidance_scale - 1) * TOLERANCE if cfg else TOLERANCE
    torch.testing.assert_close(
        final, torch.stack([t.latents[-1] for t in trajectories]), atol=bound, rtol=bound
    )


def test_each_sample_streams_its_frames_as_the_pipeline_decodes_them(family_client, family_pipeline):
    trajectories = family_client.rollout(
        family_request("hunyuan-video15", "FLOW_SDE", cfg=False, images=True, num_frames=9)
    )
    pipe = family_pipeline
    latents = torch.stack([t.latents[-1] for t in trajectories])
    assert latents.shape[2] == 3  # 9 frames: 3 latent frames
    for k, trajectory in enumerate(trajectories):
        # The pipeline's decode, a sample at a time, as served (the VAE's causal attention mask does not
        # broadcast over a batch of several in diffusers 0.41).
        with torch.no_grad():
            video = pipe.vae.decode(latents[k : k + 1] / pipe.vae.config.scaling_factor, return_dict=False)[0]
        expected = pipe.video_processor.postprocess_video(video, output_type="np")[
            0
        ]  # [F, H, W, 3] in [0, 1]
        frames = trajectory.frames()
        assert len(frames) == 9 and all(frame.size == (64, 64) for frame in frames)
        got = np.stack([np.asarray(frame.convert("RGB"), dtype=np.float64) for frame in frames])
        np.testing.assert_allclose(got, np.round(expected * 255), atol=1)


def with_guider(pipe, **config) -> HunyuanVideo15Pipeline:
    """The preset's components with another guider."""
    return HunyuanVideo15Pipeline(**{**pipe.components, "guider": ClassifierFreeGuidance(**config)})


@pytest.mark.parametrize(
    "config", [{"guidance_rescale": 0.7}, {"start": 0.2}, {"stop": 0.8}, {"enabled": False}], ids=str
)
def test_a_guider_other_than_plain_cfg_on_every_step_is_refused(family_pipeline, config):
    with pytest.raises(UnsupportedModel, match="only plain CFG on every step is served"):
        HunyuanVideo15Adapter(with_guider(family_pipeline, **config), torch.device("cpu"), torch.float32)


def test_the_guiders_original_formulation_is_cfg_around_the_positive_branch(family_pipeline):
    """use_original_formulation: v_pos + s (v_pos - v_neg), off at s = 0, as the guider computes it."""
    pipe = with_guider(family_pipeline, guidance_scale=3.0, use_original_formulation=True)
    adapter = HunyuanVideo15Adapter(pipe, torch.device("cpu"), torch.float32)
    assert (adapter.cfg_rule, adapter.cfg_off_scale, adapter.defaults().guidance_scale) == (
        "cfg_from_positive",
        0.0,
        3.0,
    )
    positive, negative = torch.randn(2, 1, 32, 2, 4, 4)
    # The same float32 operations in the same order (a difference, a product, a sum): bitwise.
    torch.testing.assert_close(
        apply_guidance(adapter.cfg_rule, 3.0, {"positive": positive, "negative": negative}),
        pipe.guider.forward(positive, negative).pred,
        rtol=0,
        atol=0,
    )


def test_sp_splits_over_ulysses_and_refuses_ring_attention(adapter):
    """Our plan and attention processor take a Ulysses split (the heads divide); ring attention, which
    would need the processor's mask of the gathered sequence cut per ring step, is refused at start-up
    with the split to use."""
    check_splittable(adapter.transformer, ParallelDims(sp=2, world_size=2))
    for split in ("ring", "ulysses+ring"):
        with pytest.raises(
            ParallelismUnsupported, match="runs on Ulysses alone: use --attention-split ulysses"
        ):
            check_splittable(adapter.transformer, ParallelDims(sp=4, attention_split=split, world_size=4))


class AttentionMasks(TorchFunctionMode):
    """The shapes of the masks handed to ``scaled_dot_product_attention`` under it."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is not None:
            self.shapes.append(tuple(kwargs["attn_mask"].shape))
        return func(*args, **kwargs)


@pytest.mark.parametrize("prompt", ["a red fox", 'a sign that reads "OPEN"'], ids=["text", "glyphs"])
def test_the_blocks_attend_as_diffusers_processor_does_without_a_square_mask(adapter, prompt):
    """Unsplit, our processor masks the keys alone ([1, 1, 1, S]) where diffusers' builds
    [1, 1, S, S]: the velocities are the same bits (the same CPU flash kernel on the same q, k and v,
    and the same scores for every unmasked query; the masked context tokens' rows never reach the
    video tokens), with and without quoted glyph text (the ByT5 tokens masked or not). The token
    refiner's masks, over the 1000 text tokens, are diffusers' (the estimate counts them)."""
    shape = MediaShape(5, 64, 96)
    sequence = adapter.generated_tokens(shape) + sum(adapter._context_tokens())
    blocks = adapter.transformer.transformer_blocks
    with AttentionMasks() as ours:
        velocity = forward_at(adapter, prompt, shape)
    try:
        for block in blocks:
            block.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
        with AttentionMasks() as theirs:
            expected = forward_at(adapter, prompt, shape)
    finally:
        for block in blocks:
            block.attn.set_processor(UlyssesAttnProcessor())
    assert torch.equal(velocity, expected)
    assert (1, 1, sequence, sequence) in theirs.shapes
    assert all(mask[-2] != sequence for mask in ours.shapes)
    assert (1, 1, 1, sequence) in ours.shapes


def test_the_decoders_attention_holds_what_the_estimate_counts(adapter):
    """The VAE decoder's mid-block attends over every latent token of a video at once through a causal
    S x S mask, on SDPA's math kernel: at 1024 tokens (a 5-frame 256 x 512 video) its tensors hold, at
    once, the mask and two float32 scores, as ``decode_attention_bytes`` counts them, besides at most
    6 [S, C] tensors (the norm, q, k, v and their copies), which grow with the tokens as the decode's
    other tensors do: the probe the estimate measures them on (``measure_vae``) holds them too."""
    shape = MediaShape(5, 256, 512)
    channels, frames, rows, cols = adapter.latent_shape(shape)
    attention = adapter.pipe.vae.decoder.mid_block.attentions[0]
    width = attention.in_channels
    tokens = frames * rows * cols
    assert tokens == 1024
    with torch.no_grad(), LiveTensorBytes() as held:
        attention(torch.zeros(1, width, frames, rows, cols))
    counted = adapter.decode_attention_bytes(shape)
    assert counted == tokens**2 * (4 + 2 * 4)
    assert counted <= held.peak <= counted + 6 * tokens * width * 4
