"""Z-Image (``ZImagePipeline``: Z-Image, Z-Image-Turbo): unpacked latents handed over one sample at a
time, the pipeline's shifted schedule, and CFG around the positive branch.

The transformer is called exactly as ``ZImagePipeline.__call__`` does:
``transformer(x, t, cap_feats, return_dict=False)``, with ``x`` the list of the samples' latents
[C, 1, H/8, W/8] (a frame axis inserted), ``t = (1000 - timestep) / 1000`` kept in float32, and
``cap_feats`` the list of the samples' caption embeddings; the velocity is the negated prediction.
The call form says all of it (``rollout_core.transformer_call``): per-sample frames, the arguments
``x`` and ``t``, the timestep subtracted from 1000 and divided by 1000, kept float32, and a negated
prediction.

The env is ``cap_feats`` and ``return_dict``. ``cap_feats`` is what ``encode_prompt`` gives one text:
the chat template applied (thinking enabled), padded to 512 tokens, the text encoder's second-to-last
hidden states at the text's own tokens (the padding dropped), here as a tensor [1, L, D] whose L is
the text's own length. Rows of equal L share a forward; other lengths run apart (the transformer
would pad them and mask the attention: the same numbers but for rounding).

CFG is the pipeline's: on when ``guidance_scale`` > 0 (``cfg_off_scale`` 0), with the negative
prompt (empty by default) as its own branch, combined per sample in float32 as
v_pos + s * (v_pos - v_neg) (``cfg_from_positive``). The pipeline's ``cfg_normalization`` and
``cfg_truncation`` are served at their defaults only: no renormalisation, CFG on every step.

The schedule is the pipeline's: ``get_default_z_image_sigmas`` (float32 linspace from 1 to 1/T), and
``mu`` from the image token count (H/16 x W/16), which the scheduler uses when its config shifts
dynamically (Z-Image-Turbo's shifts statically by 3).

Sequence parallelism: ``ZImageTransformer2DModel`` has no context-parallel plan in diffusers 0.41, so
the adapter gives its transformer one (``context_parallel_plan``). The transformer builds its
sequences inside ``forward``: the image tokens and the caption tokens, each padded to a multiple of 32,
go through their own refiner blocks, then one unified sequence (image, then caption) through the main
layers. The plan splits each of the three stacks at its first block (``x``), splits the RoPE
frequencies fed to every block (``freqs_cis``), and gathers each stack's output at its last block;
what runs between the stacks (padding, the unified sequence, the final layer) runs whole on every
rank. Each split sequence is a multiple of 32 tokens, so any degree dividing 32 cuts it evenly.
"""

from collections.abc import Iterator

import torch
from diffusers import ZImagePipeline
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import CallForm
from rollout_server.families.base import (
    FamilyAdapter,
    FamilyDefaults,
    MediaShape,
    resolution_shift,
    set_up_schedule,
    unscaled,
)

MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.__call__'s default
# The transformer stacks the plan splits: each runs over one sequence, split at its first block.
SPLIT_STACKS = ("noise_refiner", "context_refiner", "layers")


def padded(tokens: int) -> int:
    """The tokens the transformer attends over for ``tokens``: padded to a multiple of 32."""
    return tokens + (-tokens) % SEQ_MULTI_OF


def context_parallel_plan(transformer: torch.nn.Module) -> dict | None:
    """A diffusers context-parallel plan for ``ZImageTransformer2DModel`` (see the module docstring),
    or None when a stack has a single block, whose split and gather would share one plan key."""
    if any(len(getattr(transformer, stack)) < 2 for stack in SPLIT_STACKS):
        return None
    plan = {}
    for stack in SPLIT_STACKS:
        split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
        plan[f"{stack}.0"] = {"x": split}
        plan[f"{stack}.*"] = {"freqs_cis": split}
        plan[f"{stack}.{len(getattr(transformer, stack)) - 1}"] = ContextParallelOutput(
            gather_dim=1, expected_dims=3
        )
    return plan


class ZImageAdapter(FamilyAdapter):
    family = "z-image"
    pipeline_type = ZImagePipeline
    timestep_divisor = 1000.0
    timestep_rule = "(1000 - timestep) / 1000, float32"
    call_form = CallForm(
        inputs=rollout_pb2.TRANSFORMER_INPUTS_PER_SAMPLE_FRAMES,
        latents_argument="x",
        timestep_argument="t",
        timestep_offset=1000.0,
        timestep_reversed=True,
        timestep_float32=True,
        negated_prediction=True,
    )
    cfg_scale_field = "guidance_scale"
    cfg_rule = "cfg_from_positive"
    cfg_off_scale = 0.0
    batched_env_keys = ("cap_feats",)
    generated_inputs = ("x",)

    def __init__(self, pipe, device, dtype, folder=None):
        super().__init__(pipe, device, dtype, folder)
        self.pipe.transformer._cp_plan = context_parallel_plan(self.pipe.transformer)

    @property
    def side_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2

    def defaults(self) -> FamilyDefaults:
        # ZImagePipeline.__call__'s defaults.
        return FamilyDefaults(
            height=1024, width=1024, num_steps=50, guidance_scale=5.0, true_cfg_scale=1.0, noise_level=0.7
        )

    def _image_tokens(self, shape: MediaShape) -> int:
        """The image's patches before padding, as the pipeline counts them for the shift."""
        _, rows, cols = self.latent_shape(shape)
        return (rows // 2) * (cols // 2)

    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        mu = resolution_shift(self.pipe.scheduler.config, self._image_tokens(shape))
        sigmas = get_default_z_image_sigmas(num_steps)
        return set_up_schedule(self.pipe.scheduler, num_steps, sigmas=sigmas, mu=mu)

    def latent_shape(self, shape: MediaShape) -> tuple[int, ...]:
        scale = self.pipe.vae_scale_factor
        return (self.pipe.transformer.config.in_channels, shape.height // scale, shape.width // scale)

    def generated_tokens(self, shape: MediaShape) -> int:
        return padded(self._image_tokens(shape))

    def latent_packing(self) -> str:
        return (
            "unpacked: [vae_latent_channels, H/8, W/8], fed per sample as [C, 1, H/8, W/8] "
            "(the transformer patchifies 2x2 itself)"
        )

    def text_elements(self) -> int:
        return MAX_SEQUENCE_LENGTH * self.pipe.transformer.config.cap_feat_dim

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # The main layers run over the unified sequence (image, then caption, each padded); the
        # feed-forward's two gated projections are each 8/3 of the width.
        dim = self.pipe.transformer.config.dim
        tokens = self.generated_tokens(shape) + padded(MAX_SEQUENCE_LENGTH)
        return tokens, 2 * int(dim / 3 * 8)

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # guidance_scale is the CFG scale, applied when the branches are combined; the negative prompt
        # takes this path too, as the pipeline encodes it.
        embeds, _ = self.pipe.encode_prompt(
            prompt=text,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        return {"cap_feats": embeds[0].unsqueeze(0), "return_dict": False}

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        vae = self.pipe.vae
        yield vae.decode(unscaled(vae, latents), return_dict=False)[0]
