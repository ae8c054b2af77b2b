"""FLUX.2: [klein] (``Flux2KleinPipeline``, a Qwen3 text encoder and real CFG) and [dev]
(``Flux2Pipeline``, a Mistral3 text encoder and embedded guidance). Both have 2x2-patchified latents
normalised by the VAE's batch-norm statistics and a schedule shifted by the token and step counts.

The transformer is called exactly as the pipelines' ``__call__`` do, with the timestep divided by 1000,
and its kwargs (the env) are ``encoder_hidden_states``, ``txt_ids``, ``img_ids``, ``guidance``,
``joint_attention_kwargs`` and ``return_dict``. The position ids are 4-D (time, row, column, text
position) with a batch dimension of 1; the transformer reads the first row's, so they are shared by
every row of a batch.

Prompt encoding is the pipeline's ``encode_prompt``: the text encoder's chat template, padded to the
model's text length, and the hidden states of three of the encoder's layers side by side on the
channels (``joint_attention_dim`` is three times the encoder's width). The pipelines read layers 9, 18
and 27 ([klein]'s 36-layer Qwen3) and 10, 20 and 30 ([dev]'s 40-layer Mistral Small 3.1); a shallower
encoder (the tiny presets) stacks its last three hidden states instead (``stacked_text_layers``).

[klein]'s CFG is its pipeline's: with ``guidance_scale`` > 1, v_neg + s * (v_pos - v_neg), the negative
prompt (empty by default, as in the pipeline) in its own env branch, ``guidance`` None. A step-distilled
[klein] (``is_distilled`` in its ``model_index.json``) runs no CFG: the pipeline ignores
``guidance_scale`` there, so this server refuses it. [dev] runs no CFG either: ``guidance_scale`` is the
``guidance`` entry of its env, which the transformer embeds.

The schedule is the pipelines': linspace sigmas shifted by ``compute_empirical_mu`` of the image tokens
and the step count (so the same sigma index differs between step counts). The latents a transformer
consumes are the VAE latents cut into 2x2 patches (4 x ``latent_channels`` channels), normalised by the
VAE's batch-norm running statistics and packed row-major into tokens; decoding undoes the three.
"""

from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

from rollout_server.families.base import FamilyDefaults, MediaShape, PackedLatentAdapter, set_up_schedule


class Flux2FamilyAdapter(PackedLatentAdapter):
    """What FLUX.2 [klein] and [dev] share: schedule, latents, position ids, prompt encoding, decoding."""

    timestep_divisor = 1000.0
    timestep_rule = "timestep / 1000"
    generated_inputs = ("hidden_states", "img_ids")
    # The pipeline's default text layers, as indices of the text encoder's hidden states.
    pipeline_text_layers: ClassVar[tuple[int, ...]]
    # Whether the pipeline feeds the guidance scale to the transformer (the env's ``guidance``).
    feeds_guidance: ClassVar[bool]

    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        # As the pipelines' __call__: linspace sigmas unless the scheduler makes its own flow sigmas,
        # shifted by the empirical mu of the image tokens and the step count.
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if self.pipe.scheduler.config.get("use_flow_sigmas"):
            sigmas = None
        mu = compute_empirical_mu(image_seq_len=self.generated_tokens(shape), num_steps=num_steps)
        return set_up_schedule(self.pipe.scheduler, num_steps, sigmas=sigmas, mu=mu)

    def latent_packing(self) -> str:
        return (
            "flux2 2x2 patches: [(H/16) * (W/16), 4 * vae_latent_channels], batch-norm normalised, "
            "row-major over the grid"
        )

    @property
    def text_tokens(self) -> int:
        """The tokens every prompt is padded to: the model's own length (its tokenizer's, within [dev]'s
        processor), at most the pipeline's (512)."""
        tokenizer = getattr(self.pipe.tokenizer, "tokenizer", self.pipe.tokenizer)
        return min(self.pipe.tokenizer_max_length, tokenizer.model_max_length)

    @property
    def text_encoder_out_layers(self) -> tuple[int, ...]:
        """The text encoder's hidden states the prompt embedding stacks."""
        depth = self.pipe.text_encoder.config.get_text_config().num_hidden_layers
        return stacked_text_layers(depth, self.pipeline_text_layers)

    def text_elements(self) -> int:
        return self.text_tokens * self.pipe.transformer.config.joint_attention_dim

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # Joint attention over image and text tokens; a single-stream block's fused projection gives
        # the attention's q, k, v and the SwiGLU's two mlp_ratio-wide halves at once.
        config = self.pipe.transformer.config
        width = config.num_attention_heads * config.attention_head_dim
        return self.generated_tokens(shape) + self.text_tokens, int((3 + 2 * config.mlp_ratio) * width)

    def _image_ids(self, shape: MediaShape) -> torch.Tensor:
        """The generated tokens' position ids (0, row, column, 0), batch dimension 1, as the pipeline's
        prepare_latents makes them: they read the latent grid's shape only."""
        rows, cols = self._latent_grid(shape)
        return self.pipe._prepare_latent_ids(torch.empty(1, 0, rows, cols)).to(self.device)

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # One text per call: its env then depends on nothing else (every text is padded to
        # text_tokens anyway).
        embeds, txt_ids = self.pipe.encode_prompt(
            prompt=text,
            device=self.device,
            max_sequence_length=self.text_tokens,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )
        guidance = None
        if self.feeds_guidance:
            guidance = torch.full([1], guidance_scale, device=self.device, dtype=torch.float32)
        return {
            "encoder_hidden_states": embeds,
            "txt_ids": txt_ids,
            "img_ids": self._image_ids(shape),
            "guidance": guidance,
            "joint_attention_kwargs": None,
            "return_dict": False,
        }

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        # As the pipelines' __call__ after their loop: tokens back onto the grid by their ids, the
        # batch-norm statistics undone, the 2x2 patches unfolded, then the VAE. The generated tokens'
        # ids are the grid in row-major order (``_image_ids``), so their scatter is this reshape:
        # the same values in the same places, and no device sync for the grid's size.
        pipe, vae = self.pipe, self.pipe.vae
        rows, cols = self._latent_grid(shape)
        patches = latents.to(vae.dtype).view(1, rows, cols, -1).permute(0, 3, 1, 2)
        bn = vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            patches.device, patches.dtype
        )
        yield vae.decode(pipe._unpatchify_latents(patches * std + mean), return_dict=False)[0]


class Flux2KleinAdapter(Flux2FamilyAdapter):
    family = "flux2-klein"
    pipeline_type = Flux2KleinPipeline
    cfg_scale_field = "guidance_scale"
    cfg_rule = "true_cfg"
    batched_env_keys = ("encoder_hidden_states",)
    pipeline_text_layers = (9, 18, 27)
    feeds_guidance = False

    @property
    def distilled(self) -> bool:
        """A step-distilled model: a few steps, no CFG."""
        return bool(self.pipe.config.get("is_distilled", False))

    @property
    def scale_fields(self) -> tuple[str, ...]:
        return () if self.distilled else super().scale_fields

    def defaults(self) -> FamilyDefaults:
        # The pipeline's default side is default_sample_size * 8 = 1024; FLUX.2 [klein] base takes 50
        # steps at CFG 4 (the pipeline's defaults), the distilled [klein] 4 steps without CFG.
        side = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        steps, scale = (4, 1.0) if self.distilled else (50, 4.0)
        return FamilyDefaults(
            height=side,
            width=side,
            num_steps=steps,
            guidance_scale=scale,
            true_cfg_scale=1.0,
            noise_level=0.7,
        )


class Flux2Adapter(Flux2FamilyAdapter):
    """FLUX.2 [dev]: guidance-distilled, so ``guidance_scale`` is embedded (batched with the rows: it
    may differ between rollouts) and no negative branch runs; ``true_cfg_scale`` is refused above 1.
    A real checkpoint's tokenizer is Mistral's processor (Pixtral's image processor beside the
    tokenizer), which transformers builds only with torchvision; the text path reads its tokenizer."""

    family = "flux2"
    pipeline_type = Flux2Pipeline
    cfg_rule = "none"  # never applied: true_cfg_scale above 1 is refused
    batched_env_keys = ("encoder_hidden_states", "guidance")
    pipeline_text_layers = (10, 20, 30)
    feeds_guidance = True

    @property
    def scale_fields(self) -> tuple[str, ...]:
        return ("guidance_scale",)

    def defaults(self) -> FamilyDefaults:
        # The pipeline's defaults: 1024 x 1024 pixels, 50 steps, guidance 4.
        side = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return FamilyDefaults(
            height=side, width=side, num_steps=50, guidance_scale=4.0, true_cfg_scale=1.0, noise_level=0.7
        )


def stacked_text_layers(depth: int, pipeline_layers: tuple[int, ...]) -> tuple[int, ...]:
    """The hidden states of a ``depth``-layer text encoder that a prompt embedding stacks, as indices of
    its ``hidden_states`` (0: the token embeddings, ``depth``: the last layer's output): the pipeline's
    default layers where the encoder is that deep (every released FLUX.2 encoder), else its last as
    many (a two-layer encoder stacks all three of its hidden states)."""
    if depth >= max(pipeline_layers):
        return pipeline_layers
    return tuple(range(depth + 1 - len(pipeline_layers), depth + 1))
