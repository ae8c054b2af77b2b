"""An adapter's transformer called by hand: one forward at a shape, an image-conditioned family's ODE, and
the tokens its joint attention runs over; LTX-2's joint latents in its pipeline's own forms."""

from typing import Any

import torch

from rollout_core import latent_streams
from support.requests import condition_image


def adapter_ode(
    adapter, x0, texts: dict[str, list[str]], images, guidance_scale: float, rule, shape, steps=4
):
    """An image-conditioned family's ODE by hand: Euler over the adapter's schedule from ``x0``, each
    velocity by the transformer-call rule with the expert of its step and each branch's env (the
    branch's ``texts``, one per image, each merged with its image's entries and batched as the server
    batches rows), the branches combined by the guidance ``rule``."""
    from rollout_core.transformer_call import apply_guidance, call_transformer, stack_envs

    def env(text, image):
        read = image if adapter.text_reads_image else None
        return {
            **adapter.encode_text(text, guidance_scale, shape, read),
            **adapter.encode_image(image, shape),
        }

    envs = {
        branch: stack_envs(
            [env(t, i) for t, i in zip(per_image, images, strict=True)], adapter.batched_env_keys
        )
        for branch, per_image in texts.items()
    }
    sigmas, timesteps = adapter.schedule(steps, shape)
    x = x0
    for i in range(steps):
        expert = adapter.experts[adapter.expert_for(float(timesteps[i]))]
        velocities = {
            branch: call_transformer(
                expert, x, timesteps[i], env, torch.float32, adapter.timestep_divisor, adapter.conditioning
            )
            for branch, env in envs.items()
        }
        x = x + (sigmas[i + 1] - sigmas[i]) * apply_guidance(*rule, velocities)
    return x


def env_at(adapter, prompt: str, shape) -> dict[str, Any]:
    """The env of ``prompt`` at ``shape``, with an image-conditioned family's entries of
    ``condition_image(0)`` at that size (its text encoding reading the image where the family's does)."""
    image = condition_image(0).resize((shape.width, shape.height)) if adapter.takes_images else None
    env = adapter.encode_text(prompt, 1.0, shape, image if adapter.text_reads_image else None)
    return env if image is None else {**env, **adapter.encode_image(image, shape)}


def forward_at(adapter, prompt: str, shape) -> torch.Tensor:
    """One forward of the adapter's transformer on zero latents at ``shape`` with ``prompt``'s env, by
    the adapter's whole transformer-call rule (its conditioning, its call form at the shape, its
    batched entries): the velocity."""
    return forward_of(adapter, env_at(adapter, prompt, shape), shape)


def forward_of(adapter, env: dict[str, Any], shape) -> torch.Tensor:
    """``forward_at`` with the env given (the call takes its conditioning entry out of it)."""
    from rollout_core.transformer_call import call_transformer

    x = torch.zeros(1, *adapter.latent_shape(shape))
    with torch.no_grad():
        return call_transformer(
            adapter.transformer,
            x,
            500.0,
            env,
            torch.float32,
            adapter.timestep_divisor,
            adapter.conditioning,
            form=adapter.call_form_for(shape),
            batched_env_keys=adapter.batched_env_keys,
        )


def joint_attention_tokens(adapter, env: dict, shape) -> int:
    """The tokens the first transformer block's joint attention runs over (generated, conditioning and
    text) in one forward of ``env`` by the transformer-call rule, which must give x's shape back."""
    from rollout_core.transformer_call import call_transformer

    seen = []

    def record(module, args, kwargs):
        seen.append(kwargs["hidden_states"].shape[1] + kwargs["encoder_hidden_states"].shape[1])

    handle = adapter.transformer.transformer_blocks[0].register_forward_pre_hook(record, with_kwargs=True)
    try:
        x = torch.zeros(1, *adapter.latent_shape(shape))
        v = call_transformer(adapter.transformer, x, 1000.0, env, torch.float32, 1000.0, adapter.conditioning)
    finally:
        handle.remove()
    assert v.shape == x.shape
    return seen[0]


def video_and_audio(pipe, joint: torch.Tensor, streams) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's output_type="latent" forms of joint latents [B, N]: the video unpacked and
    denormalised [B, C, F', H', W'], the audio denormalised and unpacked [B, C, L, M']."""
    video, audio = latent_streams.split(joint, streams)
    video = pipe._unpack_latents(video, 2, 2, 2)
    video = pipe._denormalize_latents(
        video, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
    )
    audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
    mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    return video, pipe._unpack_audio_latents(audio, streams[1].shape[0], num_mel_bins=mel_bins)
