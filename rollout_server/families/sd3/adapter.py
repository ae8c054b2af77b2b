"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): unpacked latents, static-shift schedule,
classic CFG.

The transformer is called exactly as ``StableDiffusion3Pipeline.__call__`` does, with the raw timestep
(sigma * 1000), and its kwargs (the env) are ``encoder_hidden_states`` (CLIP-L + CLIP-G hidden states
padded to the T5 width, followed by the T5 sequence), ``pooled_projections`` (both CLIP projections),
``joint_attention_kwargs`` and ``return_dict``. CFG is SD3's own: the ``guidance_scale`` field scales
v_neg + s * (v_pos - v_neg), with an empty negative prompt as the unconditional branch.
"""

from collections.abc import Iterator

import torch
from diffusers import StableDiffusion3Pipeline

from rollout_server.families.base import (
    FamilyAdapter,
    FamilyDefaults,
    MediaShape,
    resolution_shift,
    set_up_schedule,
    unscaled,
)

# StableDiffusion3Pipeline.__call__'s default T5 length.
MAX_SEQUENCE_LENGTH = 256
# The text states: CLIP's 77 tokens, then T5's.
TEXT_TOKENS = 77 + MAX_SEQUENCE_LENGTH


class SD3Adapter(FamilyAdapter):
    family = "sd3"
    pipeline_type = StableDiffusion3Pipeline
    timestep_divisor = 1.0
    timestep_rule = "timestep"
    cfg_scale_field = "guidance_scale"
    cfg_rule = "true_cfg"
    batched_env_keys = ("encoder_hidden_states", "pooled_projections")

    @property
    def side_multiple(self) -> int:
        return self.pipe.vae_scale_factor * self.pipe.patch_size

    def defaults(self) -> FamilyDefaults:
        # SD3.5-Medium's usual settings; the pipeline's default side is default_sample_size * 8. SD3 has
        # no true CFG on top of its classic CFG, so true_cfg_scale stays 1.
        side = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return FamilyDefaults(
            height=side, width=side, num_steps=40, guidance_scale=4.5, true_cfg_scale=1.0, noise_level=0.7
        )

    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        # As StableDiffusion3Pipeline.__call__: the scheduler's own static shift, or with dynamic shifting
        # a shift that follows the image token count.
        kwargs = {}
        if self.pipe.scheduler.config.get("use_dynamic_shifting", None):
            tokens = self.generated_tokens(shape)
            kwargs["mu"] = resolution_shift(self.pipe.scheduler.config, tokens, max_shift_default=1.16)
        return set_up_schedule(self.pipe.scheduler, num_steps, **kwargs)

    def latent_shape(self, shape: MediaShape) -> tuple[int, ...]:
        scale = self.pipe.vae_scale_factor
        return (self.pipe.transformer.config.in_channels, shape.height // scale, shape.width // scale)

    def generated_tokens(self, shape: MediaShape) -> int:
        patch_size = self.pipe.transformer.config.patch_size
        _, rows, cols = self.latent_shape(shape)
        return (rows // patch_size) * (cols // patch_size)

    def latent_packing(self) -> str:
        return "unpacked: [vae_latent_channels, H/8, W/8] (the transformer patchifies 2x2 itself)"

    def text_elements(self) -> int:
        config = self.pipe.transformer.config
        return TEXT_TOKENS * config.joint_attention_dim + config.pooled_projection_dim

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # Joint attention over image patches and text tokens; the feed-forward is 4x wide.
        config = self.pipe.transformer.config
        _, rows, cols = self.latent_shape(shape)
        patches = (rows // config.patch_size) * (cols // config.patch_size)
        return patches + TEXT_TOKENS, 4 * config.num_attention_heads * config.attention_head_dim

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # guidance_scale is SD3's CFG scale, applied when the branches are combined. The negative prompt
        # takes this path too: without clip_skip it is the pipeline's negative-branch computation.
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[text],
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        return {
            "encoder_hidden_states": embeds,
            "pooled_projections": pooled,
            "joint_attention_kwargs": None,
            "return_dict": False,
        }

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        vae = self.pipe.vae
        yield vae.decode(unscaled(vae, latents), return_dict=False)[0]
