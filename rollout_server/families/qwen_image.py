"""Qwen-Image (``QwenImagePipeline``): packed 2x2 latents, dynamic-shift schedule, true CFG with norm rescale.

The transformer is called exactly as ``QwenImagePipeline.__call__`` does, with the timestep divided by 1000.
Its kwargs (the env) are ``encoder_hidden_states``, ``encoder_hidden_states_mask``, ``img_shapes``,
``guidance`` (guidance-distilled models only), ``attention_kwargs`` and ``return_dict``. Each prompt is
encoded on its own, so its env carries its own token length, unpadded; the mask is then all ones, which
``encode_prompt`` returns as None. This diffusers version's transformer reads the text lengths off the
embeddings, so there is no ``txt_seq_lens`` to slice per sample.
"""

from collections.abc import Iterator

import torch
from diffusers import QwenImagePipeline
from PIL import Image

from rollout_server.families.base import (
    FamilyDefaults,
    MediaShape,
    PackedLatentAdapter,
    denormalized,
)

MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default


class QwenImageAdapter(PackedLatentAdapter):
    family = "qwen-image"
    pipeline_type = QwenImagePipeline
    timestep_divisor = 1000.0
    timestep_rule = "timestep / 1000"
    cfg_scale_field = "true_cfg_scale"
    cfg_rule = "true_cfg_norm_rescale"
    batched_env_keys = ("encoder_hidden_states", "encoder_hidden_states_mask", "img_shapes", "guidance")

    def defaults(self) -> FamilyDefaults:
        # Qwen-Image's usual settings; the pipeline's default side is default_sample_size * 8 = 1024.
        side = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return FamilyDefaults(
            height=side, width=side, num_steps=50, guidance_scale=1.0, true_cfg_scale=4.0, noise_level=0.7
        )

    def latent_packing(self) -> str:
        return "qwen-image 2x2 patches: [(H/16) * (W/16), 4 * vae_z_dim], row-major over the grid"

    def text_elements(self) -> int:
        return MAX_SEQUENCE_LENGTH * self.pipe.transformer.config.joint_attention_dim

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # Joint attention over image and text tokens; the feed-forward is 4x wide.
        rows, cols = self._latent_grid(shape)
        config = self.pipe.transformer.config
        return rows * cols + MAX_SEQUENCE_LENGTH, 4 * config.num_attention_heads * config.attention_head_dim

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape) -> dict:
        # One text per encode_prompt call: a batch would pad every prompt to the longest.
        embeds, mask = self.pipe.encode_prompt(
            prompt=text, device=self.device, max_sequence_length=MAX_SEQUENCE_LENGTH
        )
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.full([1], guidance_scale, device=self.device, dtype=torch.float32)
        rows, cols = self._latent_grid(shape)
        return {
            "encoder_hidden_states": embeds,
            "encoder_hidden_states_mask": mask,
            "img_shapes": [[(1, rows, cols)]],
            "guidance": guidance,
            "attention_kwargs": {},
            "return_dict": False,
        }

    @torch.no_grad()
    def decode_frames(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[list[Image.Image]]:
        vae = self.pipe.vae
        latents = self.pipe._unpack_latents(latents, shape.height, shape.width, self.pipe.vae_scale_factor)
        images = vae.decode(denormalized(vae, latents), return_dict=False)[0][:, :, 0]  # its single frame
        yield self.pipe.image_processor.postprocess(images, output_type="pil")
