"""Wan 2.1 and 2.2 text-to-video's pipelines from their published configs, at a preset's size or a
checkpoint's.

Every component is the real diffusers/transformers class with Wan's structure:
- a WanTransformer3DModel with 1x2x2 patches, 3D RoPE, RMS qk-norm and cross-attention to the text;
- the causal 3D AutoencoderKLWan (8x spatial and 4x temporal downsampling, 16 latent channels with
  Wan's per-channel latents mean and std);
- a UMT5 text encoder with a locally trained SentencePiece tokenizer;
- the UniPC flow-matching scheduler with Wan's flow shift.

Wan 2.2 adds a second expert, ``transformer_2``, which the pipeline runs on the steps whose timestep is
below ``boundary_ratio * 1000``. The image-to-video builder takes its components from here.
"""

import functools
from typing import TYPE_CHECKING

from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from rollout_server.families.common import components
from rollout_server.families.wan.published import (
    UMT5_TOKENIZER,
    UMT5_XXL,
    WAN22_BOUNDARY_RATIO,
    WAN_1_3B,
    WAN_14B,
    WAN_SCHEDULER_CONFIG,
    WAN_VAE,
)

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def wan(target: "Build", transformer=WAN_1_3B, experts: int = 1) -> WanPipeline:
    """A WanPipeline of Wan 2.1's components, the ``transformer`` config's (1.3B's); two ``experts``
    make Wan 2.2's."""
    return WanPipeline(
        **umt5_text(target),
        vae=wan_vae(target),
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
        transformer=wan_transformer(target, 1, transformer),
        transformer_2=wan_transformer(target, 3, transformer) if experts == 2 else None,
        boundary_ratio=WAN22_BOUNDARY_RATIO if experts == 2 else None,
    )


wan_2_2 = functools.partial(wan, transformer=WAN_14B, experts=2)


def umt5_text(target: "Build"):
    """The UMT5 tokenizer and encoder, by component name."""
    return components.t5_text(
        target,
        2,
        UMT5_XXL,
        published_tokenizer=UMT5_TOKENIZER,
        model_class=UMT5EncoderModel,
        config_class=UMT5Config,
    )


def wan_vae(target: "Build") -> AutoencoderKLWan:
    """The causal 3D VAE."""
    return components.model(target, 0, "vae", AutoencoderKLWan, WAN_VAE)


def wan_transformer(target: "Build", seed: int, published=WAN_1_3B, **settings) -> WanTransformer3DModel:
    """A denoising transformer of ``published`` at this size, seeded with ``seed``; ``settings`` replace
    fields of the result (another layout's input channels)."""
    return components.model(target, seed, "transformer", WanTransformer3DModel, published, **settings)
