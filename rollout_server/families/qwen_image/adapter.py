"""Qwen-Image (``QwenImagePipeline``): packed 2x2 latents, dynamic-shift schedule, true CFG with norm rescale;
and Qwen-Image-Edit (``QwenImageEditPipeline``), which edits a conditioning image.

The transformer is called exactly as ``QwenImagePipeline.__call__`` does, with the timestep divided by 1000.
Its kwargs (the env) are ``encoder_hidden_states``, ``encoder_hidden_states_mask``, ``img_shapes``,
``guidance`` (guidance-distilled models only), ``attention_kwargs`` and ``return_dict``. Each prompt is
encoded on its own, so its env carries its own token length, unpadded; the mask is then all ones, which
``encode_prompt`` returns as None. This diffusers version's transformer reads the text lengths off the
embeddings, so there is no ``txt_seq_lens`` to slice per sample.
"""

from collections.abc import Iterator

import torch
from diffusers import QwenImageEditPipeline, QwenImagePipeline
from PIL import Image

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import LatentConditioning
from rollout_server.errors import TextTooLong
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
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # One text per encode_prompt call: a batch would pad every prompt to the longest.
        embeds, mask = self.pipe.encode_prompt(
            prompt=text, device=self.device, max_sequence_length=MAX_SEQUENCE_LENGTH
        )
        rows, cols = self._latent_grid(shape)
        return {**self._text_env(embeds, mask, guidance_scale), "img_shapes": [[(1, rows, cols)]]}

    def _text_env(self, embeds: torch.Tensor, mask: torch.Tensor | None, guidance_scale: float) -> dict:
        """The env entries of a text's encoding and the guidance scale: all but the image shapes."""
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.full([1], guidance_scale, device=self.device, dtype=torch.float32)
        return {
            "encoder_hidden_states": embeds,
            "encoder_hidden_states_mask": mask,
            "guidance": guidance,
            "attention_kwargs": {},
            "return_dict": False,
        }

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        vae = self.pipe.vae
        latents = self.pipe._unpack_latents(latents, shape.height, shape.width, self.pipe.vae_scale_factor)
        yield vae.decode(denormalized(vae, latents), return_dict=False)[0][:, :, 0]  # its single frame


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit: Qwen-Image's transformer call with the conditioning image's packed latents
    appended to the generated tokens (their velocity is predicted too, and dropped), and a prompt
    encoding that reads the image.

    As ``QwenImageEditPipeline.__call__`` does, the image enters twice: the Qwen2.5-VL text encoder
    reads it through the edit template's vision tokens, so a prompt's embedding depends on its image
    (and the negative prompt is encoded with the same image), and the VAE encodes it into latents
    (the latent mode, normalised by ``latents_mean`` and ``latents_std``), packed 2x2 like the
    generated ones. ``img_shapes`` has two entries per sample, the generated grid then the image's,
    for the transformer's RoPE. The schedule's shift counts the generated tokens only, as the
    pipeline's does.

    The pipeline resizes the image to about 1024 x 1024 pixels of its aspect ratio
    (``calculate_dimensions``) before both encodings, whatever the output size; here both the VL
    encoder and the VAE see the image at the request's height x width, as the server gives it, so
    the image adds as many tokens as the generated ones. The VL processor then resizes it to its
    own patch grid (within its min and max pixels), as it does in the pipeline.
    """

    family = "qwen-image-edit"
    pipeline_type = QwenImageEditPipeline
    conditioning = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_SEQUENCE, "image_latents")
    takes_images = True
    text_reads_image = True
    image_encoding = (
        "pixels scaled to [-1, 1]; VAE latent mode, (z - latents_mean) / latents_std; packed 2x2 into "
        "tokens appended after the generated ones (img_shapes: the generated grid, then the image's); "
        "the Qwen2.5-VL prompt encoding reads the image too"
    )
    batched_env_keys = (*QwenImageAdapter.batched_env_keys, "image_latents")

    def conditioning_tokens(self, shape: MediaShape) -> int:
        # The image is at the request's size: as many tokens as the generated ones.
        return self.generated_tokens(shape)

    def _vision_tokens(self, height: int, width: int) -> int:
        """The tokens the VL encoder's vision tower gives an image of ``height`` x ``width``: its
        processor's patches, merged."""
        processor = self.pipe.processor.image_processor
        return processor.get_number_of_image_patches(height, width) // processor.merge_size**2

    def _text_tokens(self, vision_tokens: int) -> int:
        """The longest prompt embedding around ``vision_tokens`` image tokens: the edit template's
        tokens after the dropped system prefix (its one image placeholder expanded) and the
        pipeline's longest prompt (``tokenizer_max_length``; its encode_prompt truncates nothing, so
        ``encode_text`` refuses a longer one)."""
        pipe = self.pipe
        tail = self._template_tokens("") - pipe.prompt_template_encode_start_idx - 1  # less the placeholder
        return tail + vision_tokens + pipe.tokenizer_max_length

    def _template_tokens(self, text: str) -> int:
        """The tokens of the edit template around ``text`` (its image placeholder one token)."""
        return len(self.pipe.tokenizer(self.pipe.prompt_template_encode.format(text)).input_ids)

    def text_elements(self) -> int:
        # At its longest the image fills the processor's max pixels.
        processor = self.pipe.processor.image_processor
        vision_tokens = processor.size["longest_edge"] // (processor.patch_size * processor.merge_size) ** 2
        return self._text_tokens(vision_tokens) * self.pipe.transformer.config.joint_attention_dim

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # Joint attention over the generated, the image's and the text's tokens (the VL encoder's
        # image tokens among them); the feed-forward is 4x wide.
        config = self.pipe.transformer.config
        text = self._text_tokens(self._vision_tokens(shape.height, shape.width))
        tokens = self.generated_tokens(shape) + self.conditioning_tokens(shape) + text
        return tokens, 4 * config.num_attention_heads * config.attention_head_dim

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # The text sits between special tokens, which no merge crosses: its own tokens are the
        # template's with it less the template's without it. Counted before the VL encoder runs.
        tokens = self._template_tokens(text) - self._template_tokens("")
        if tokens > self.pipe.tokenizer_max_length:
            raise TextTooLong(tokens, self.pipe.tokenizer_max_length)
        # img_shapes cover the image's tokens too: encode_image gives them.
        embeds, mask = self.pipe.encode_prompt(prompt=text, image=image, device=self.device)
        return self._text_env(embeds, mask, guidance_scale)

    @torch.no_grad()
    def encode_image(self, image: Image.Image, shape: MediaShape) -> dict:
        pipe = self.pipe
        pixels = pipe.image_processor.preprocess(image, shape.height, shape.width).unsqueeze(2)  # 1 frame
        # An empty x: the sampler draws the noise, the pipeline's own draw would take the global RNG.
        _, image_latents = pipe.prepare_latents(
            pixels,
            1,
            pipe.transformer.config.in_channels // 4,
            shape.height,
            shape.width,
            self.dtype,
            self.device,
            None,
            latents=torch.empty(0),
        )
        rows, cols = self._latent_grid(shape)
        return {self.conditioning.env_key: image_latents, "img_shapes": [[(1, rows, cols), (1, rows, cols)]]}
