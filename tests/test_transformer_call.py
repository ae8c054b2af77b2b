"""The transformer-call rule: the typed record of the stream, and conditioning latents concatenated on the
sequence axis or on channels, checked against the diffusers pipelines that feed them that way (a step of
FluxKontextPipeline and of WanImageToVideoPipeline, each over a tiny transformer of its real class)."""

import copy

import pytest
import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    WanImageToVideoPipeline,
    WanTransformer3DModel,
)
from PIL import Image
from support.requests import stream_events

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import (
    BATCHED_CALL,
    NO_CONDITIONING,
    CallForm,
    LatentConditioning,
    TransformerCall,
    apply_guidance,
    call_transformer,
)
from rollout_server.families.z_image.adapter import ZImageAdapter

SEQUENCE = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_SEQUENCE, "image_latents")
CHANNELS = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_CHANNELS, "condition")


def test_the_started_event_states_no_conditioning(client):
    started = stream_events(client, prompts=["a fox"], height=64, width=64, num_steps=1, images=False).started
    message = started.message.transformer_call
    assert message.conditioning.concat == rollout_pb2.CONDITIONING_CONCAT_NONE
    call = TransformerCall.from_proto(message)
    assert call.conditioning == NO_CONDITIONING
    assert TransformerCall.from_json(call.to_json()) == call
    assert call.to_proto() == message


def test_transformer_calls_of_other_versions_load():
    """A record without the conditioning field (servers and files before it) reads as NONE; fields of a
    later version are ignored."""
    earlier = (
        '{"transformer_class": "FluxTransformer2DModel", "model_dtype": "float32", "timestep_divisor":'
        ' 1000.0, "timestep_rule": "timestep / 1000", "branches": ["positive", "negative"], "guidance_rule":'
        ' "true_cfg", "guidance_rule_scale": 2.0, "batched_env_keys": ["encoder_hidden_states"]}'
    )
    call = TransformerCall.from_json(earlier)
    assert call == TransformerCall(
        transformer_class="FluxTransformer2DModel",
        model_dtype="float32",
        timestep_divisor=1000.0,
        timestep_rule="timestep / 1000",
        guidance_rule="true_cfg",
        guidance_rule_scale=2.0,
        branches=("positive", "negative"),
        batched_env_keys=("encoder_hidden_states",),
    )
    assert call.conditioning == NO_CONDITIONING and call.form == BATCHED_CALL
    assert TransformerCall.from_proto(rollout_pb2.TransformerCall()).conditioning == NO_CONDITIONING
    # Before the form's fields: tensors under hidden_states and timestep, t / divisor cast, as it is.
    assert TransformerCall.from_proto(rollout_pb2.TransformerCall()).form == CallForm(
        rollout_pb2.TRANSFORMER_INPUTS_BATCHED, "hidden_states", "timestep", 0.0, False, False, False
    )
    later = call.to_json()[:-1] + ', "tree_branching": {"factor": 2}}'
    assert TransformerCall.from_json(later) == call


def test_the_z_image_form_travels_and_an_unknown_form_is_refused(tiny_transformer):
    """Z-Image's form survives the proto and a saved file's JSON; a form of inputs this client does
    not know is refused before any forward, as an unknown conditioning rule is."""
    call = TransformerCall(
        transformer_class="ZImageTransformer2DModel",
        model_dtype="bfloat16",
        timestep_divisor=1000.0,
        timestep_rule=ZImageAdapter.timestep_rule,
        guidance_rule="cfg_from_positive",
        guidance_rule_scale=4.0,
        branches=("positive", "negative"),
        batched_env_keys=("cap_feats",),
        form=ZImageAdapter.call_form,
    )
    assert TransformerCall.from_proto(call.to_proto()) == call
    assert TransformerCall.from_json(call.to_json()) == call
    later = CallForm(inputs=len(rollout_pb2.TransformerInputs.values()))
    with pytest.raises(ValueError, match="unknown transformer inputs"):
        call_transformer(
            tiny_transformer, torch.zeros(1, 16, 16), 500.0, {}, torch.float32, 1000.0, form=later
        )


def test_cfg_from_positive_is_the_pipelines_combination_negated():
    """Z-Image's pipeline combines the raw predictions p + s (p - q) and negates the sum; the rule on
    the negated branches gives the same numbers (negation is exact, rounding symmetric in sign)."""
    generator = torch.Generator().manual_seed(0)
    p, q = torch.randn(2, 4096, generator=generator)
    for scale in (0.5, 4.0, 7.3):
        pipeline = -(p + scale * (p - q))
        ours = apply_guidance("cfg_from_positive", scale, {"positive": -p, "negative": -q})
        assert torch.equal(ours, pipeline), scale


def test_an_unknown_conditioning_rule_is_refused(tiny_transformer):
    later = LatentConditioning(concat=len(rollout_pb2.ConditioningConcat.values()), env_key="image_latents")
    with pytest.raises(ValueError, match="unknown conditioning concat"):
        call_transformer(tiny_transformer, torch.zeros(1, 16, 16), 500.0, {}, torch.float32, 1000.0, later)


class FirstCall:
    """Records the keyword arguments of a module's first forward."""

    def __init__(self, module: torch.nn.Module):
        self.kwargs = None
        self.handle = module.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        if self.kwargs is None:
            self.kwargs = dict(kwargs)

    def env(self) -> dict:
        """The call's env: every keyword argument but the hidden states and the timestep."""
        return {key: value for key, value in self.kwargs.items() if key not in ("hidden_states", "timestep")}


def first_step(pipe, **call) -> tuple[torch.Tensor, torch.Tensor, FirstCall]:
    """Run ``pipe`` for two Euler steps: (the timestep and latents after its first step, its first
    transformer call)."""
    steps = []

    def on_step_end(pipe, i, t, tensors):
        steps.append((t, tensors["latents"].clone()))
        return tensors

    recorded = FirstCall(pipe.transformer)
    try:
        with torch.no_grad():
            pipe(num_inference_steps=2, output_type="latent", callback_on_step_end=on_step_end, **call)
    finally:
        recorded.handle.remove()
    return *steps[0], recorded


def euler_step(pipe, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    sigmas = pipe.scheduler.sigmas
    return x + (sigmas[1] - sigmas[0]) * v


def test_sequence_rule_is_flux_kontexts(family_resources):
    """FLUX.1 Kontext appends the image's tokens to the generated ones and keeps the first N of the
    prediction; call_transformer with the SEQUENCE rule gives the velocity of its step."""
    flux = family_resources.pipeline("flux")
    pipe = FluxKontextPipeline.from_pipe(flux, scheduler=copy.deepcopy(flux.scheduler))
    pipe.set_progress_bar_config(disable=True)
    channels = pipe.transformer.config.in_channels // 4
    side = 64 // pipe.vae_scale_factor
    generator = torch.Generator().manual_seed(3)
    noise, image_latents = torch.randn(2, 1, channels, side, side, generator=generator)
    x = pipe._pack_latents(noise, 1, channels, side, side)
    # A latent tensor as the image: Kontext packs it as the image's tokens, with no VAE in between.
    t, after, recorded = first_step(
        pipe,
        prompt="a red fox",
        image=image_latents,
        height=64,
        width=64,
        max_area=64 * 64,  # Kontext resizes to this area: keep 64 x 64
        _auto_resize=False,
        latents=x,
    )
    assert recorded.kwargs["hidden_states"].shape[1] == 2 * x.shape[1]
    env = {**recorded.env(), SEQUENCE.env_key: pipe._pack_latents(image_latents, 1, channels, side, side)}
    v = call_transformer(pipe.transformer, x, t, env, torch.float32, 1000.0, SEQUENCE)
    assert v.shape == x.shape
    assert torch.equal(euler_step(pipe, x, v), after)  # bitwise: the same operations
    # The image's tokens matter: other conditioning latents give another step.
    env[SEQUENCE.env_key] = torch.zeros_like(env[SEQUENCE.env_key])
    v_other = call_transformer(pipe.transformer, x, t, env, torch.float32, 1000.0, SEQUENCE)
    assert (euler_step(pipe, x, v_other) - after).abs().max() > 1e-3


def test_channel_rule_is_wan_image_to_videos(family_resources):
    """Wan 2.1 image-to-video concatenates the mask and the image's latents to the generated channels;
    call_transformer with the CHANNELS rule gives the velocity of its step."""
    wan = family_resources.pipeline("wan")
    channels = wan.vae.config.z_dim
    torch.manual_seed(0)
    # The mask (one channel per frame of a latent frame) and the image's latents, after x's channels.
    config = {**wan.transformer.config, "in_channels": channels + wan.vae_scale_factor_temporal + channels}
    transformer = WanTransformer3DModel.from_config(config).eval()
    pipe = WanImageToVideoPipeline(
        tokenizer=wan.tokenizer,
        text_encoder=wan.text_encoder,
        vae=wan.vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    size, frames = 32, 5
    generator = torch.Generator().manual_seed(4)
    pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8, generator=generator)
    image = Image.fromarray(pixels.numpy())
    latent_frames, latent_side = (frames - 1) // pipe.vae_scale_factor_temporal + 1, size // 8
    x = torch.randn(1, channels, latent_frames, latent_side, latent_side, generator=generator)
    with torch.no_grad():  # the text-to-video pipeline's encoding: its image-to-video twin's needs ftfy
        prompt_embeds, _ = wan.encode_prompt("a red fox", do_classifier_free_guidance=False, device="cpu")
    t, after, recorded = first_step(
        pipe,
        prompt_embeds=prompt_embeds,
        guidance_scale=1.0,  # no CFG: one branch
        image=image,
        height=size,
        width=size,
        num_frames=frames,
        latents=x,
    )
    with torch.no_grad():
        pixels_in = pipe.video_processor.preprocess(image, height=size, width=size).float()
        _, condition = pipe.prepare_latents(pixels_in, 1, channels, size, size, frames, torch.float32, "cpu")
    env = {**recorded.env(), CHANNELS.env_key: condition}
    with torch.no_grad():
        v = call_transformer(transformer, x, t, env, torch.float32, 1.0, CHANNELS)
    assert v.shape == x.shape
    assert torch.equal(euler_step(pipe, x, v), after)  # bitwise: the same operations
    env[CHANNELS.env_key] = torch.zeros_like(condition)
    with torch.no_grad():
        v_other = call_transformer(transformer, x, t, env, torch.float32, 1.0, CHANNELS)
    assert (euler_step(pipe, x, v_other) - after).abs().max() > 1e-3
