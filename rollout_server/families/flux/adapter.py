"""FLUX.1 (``FluxPipeline``): packed 2x2 latents, dynamic-shift schedule, embedded guidance, true CFG;
and FLUX.1 Kontext (``FluxKontextPipeline``), which edits a conditioning image.

The transformer is called exactly as ``FluxPipeline.__call__`` does, with the timestep divided by
1000, and its kwargs (the env) are ``encoder_hidden_states``, ``pooled_projections``, ``guidance``
(guidance-distilled models only), ``txt_ids``, ``img_ids``, ``joint_attention_kwargs`` and
``return_dict``. Kontext's env adds the image's packed latents (``image_latents``), which
``FluxKontextPipeline.__call__`` appends to the generated tokens, and its ``img_ids`` cover both.
"""

import dataclasses
from collections.abc import Iterator

import torch
from diffusers import FluxKontextPipeline, FluxPipeline
from PIL import Image

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import LatentConditioning
from rollout_server.families.base import FamilyDefaults, MediaShape, PackedLatentAdapter, unscaled

# FLUX.1's T5 text length; a model whose tokenizer says less pads its prompts to that.
MAX_SEQUENCE_LENGTH = 512


class FluxAdapter(PackedLatentAdapter):
    family = "flux"
    pipeline_type = FluxPipeline
    timestep_divisor = 1000.0
    timestep_rule = "timestep / 1000"
    batched_env_keys = ("encoder_hidden_states", "pooled_projections", "guidance")
    generated_inputs = ("hidden_states", "img_ids")

    def defaults(self) -> FamilyDefaults:
        # FLUX.1-dev's usual settings; the pipeline's default side is default_sample_size * 8.
        side = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return FamilyDefaults(
            height=side, width=side, num_steps=28, guidance_scale=3.5, true_cfg_scale=1.0, noise_level=0.7
        )

    def latent_packing(self) -> str:
        return "flux 2x2 patches: [(H/16) * (W/16), 4 * vae_latent_channels], row-major over the grid"

    @property
    def text_tokens(self) -> int:
        """The T5 tokens every prompt is padded to: the model's own length (its tokenizer's), at most
        FLUX.1's."""
        return min(MAX_SEQUENCE_LENGTH, self.pipe.tokenizer_2.model_max_length)

    def text_elements(self) -> int:
        config = self.pipe.transformer.config
        return self.text_tokens * config.joint_attention_dim + config.pooled_projection_dim

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # Joint attention over image and text tokens; a single-stream block concatenates its attention
        # output with its 4x MLP hidden state.
        rows, cols = self._latent_grid(shape)
        config = self.pipe.transformer.config
        return rows * cols + self.text_tokens, 5 * config.num_attention_heads * config.attention_head_dim

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        rows, cols = self._latent_grid(shape)
        img_ids = self.pipe._prepare_latent_image_ids(1, rows, cols, self.device, self.dtype)
        return {**self._text_env(text, guidance_scale), "img_ids": img_ids}

    def _text_env(self, text: str, guidance_scale: float) -> dict:
        """The env entries of the text and the guidance scale: all but the image tokens' ids."""
        embeds, pooled, txt_ids = self.pipe.encode_prompt(
            prompt=[text], prompt_2=None, device=self.device, max_sequence_length=self.text_tokens
        )
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.full([1], guidance_scale, device=self.device, dtype=torch.float32)
        return {
            "encoder_hidden_states": embeds,
            "pooled_projections": pooled,
            "guidance": guidance,
            "txt_ids": txt_ids,
            "joint_attention_kwargs": None,
            "return_dict": False,
        }

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        vae = self.pipe.vae
        spatial = self.pipe._unpack_latents(
            latents.to(vae.dtype), shape.height, shape.width, self.pipe.vae_scale_factor
        )
        yield vae.decode(unscaled(vae, spatial), return_dict=False)[0]


class FluxKontextAdapter(FluxAdapter):
    """FLUX.1 Kontext: FLUX.1's transformer call with the conditioning image's tokens appended to the
    generated ones (their velocity is predicted too, and dropped), at position ids whose first
    coordinate is 1. The schedule's shift counts the generated tokens only, as the pipeline's does."""

    family = "flux-kontext"
    pipeline_type = FluxKontextPipeline
    conditioning = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_SEQUENCE, "image_latents")
    takes_images = True
    image_encoding = (
        "pixels scaled to [-1, 1]; VAE latent mode, (z - shift_factor) * scaling_factor; packed 2x2 "
        "into tokens appended after the generated ones, at img_ids (1, row, column)"
    )
    batched_env_keys = (*FluxAdapter.batched_env_keys, "image_latents")

    def defaults(self) -> FamilyDefaults:
        # FLUX.1 Kontext dev's usual embedded guidance.
        return dataclasses.replace(super().defaults(), guidance_scale=2.5)

    def conditioning_tokens(self, shape: MediaShape) -> int:
        # The image is resized to the request's size: as many tokens as the generated ones.
        return self.generated_tokens(shape)

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        tokens, width = super().forward_activation(shape)
        return tokens + self.conditioning_tokens(shape), width

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # img_ids cover the image's tokens too: encode_image gives them.
        return self._text_env(text, guidance_scale)

    @torch.no_grad()
    def encode_image(self, image: Image.Image, shape: MediaShape) -> dict:
        pipe = self.pipe
        pixels = pipe.image_processor.preprocess(image, shape.height, shape.width)
        channels = pipe.transformer.config.in_channels // 4
        # An empty x: the sampler draws the noise, the pipeline's own draw would take the global RNG.
        _, image_latents, latent_ids, image_ids = pipe.prepare_latents(
            pixels,
            1,
            channels,
            shape.height,
            shape.width,
            self.dtype,
            self.device,
            latents=torch.empty(0),
        )
        return {
            self.conditioning.env_key: image_latents,
            "img_ids": torch.cat([latent_ids, image_ids]),  # as FluxKontextPipeline.__call__
        }
