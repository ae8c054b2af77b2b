"""FLUX.1-dev's pipeline from its published configs, at a preset's size or the checkpoint's.

Every component is the real diffusers/transformers class with FLUX.1-dev's structure (guidance embedding,
2x2 latent packing, 8x VAE downsampling, CLIP pooled + T5 sequence conditioning, dynamic-shift flow-matching
scheduler). FLUX.1 Kontext dev has FLUX.1-dev's components and configs, under FluxKontextPipeline (which
appends a conditioning image's tokens to the generated ones).
"""

import functools
from typing import TYPE_CHECKING

from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import CLIPTextModel

from rollout_server.families.common import components
from rollout_server.families.common.published import (
    CLIP_L,
    FLUX_1_SCHEDULER,
    FLUX_1_VAE,
    T5_TOKENIZER,
    T5_XXL,
)
from rollout_server.families.flux.published import FLUX_1_DEV, FLUX_T5_TOKENS

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def flux(target: "Build", pipeline_class: type[FluxPipeline] = FluxPipeline) -> FluxPipeline:
    """A ``pipeline_class`` (FluxPipeline or FluxKontextPipeline) of FLUX.1-dev's components."""
    t5_tokenizer = {**T5_TOKENIZER, "model_max_length": FLUX_T5_TOKENS}
    return pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_1_SCHEDULER),
        vae=components.model(target, 1, "vae", AutoencoderKL, FLUX_1_VAE),
        **components.clip_text(target, 2, CLIPTextModel, CLIP_L),
        **components.t5_text(target, 3, T5_XXL, ("tokenizer_2", "text_encoder_2"), t5_tokenizer),
        transformer=components.model(target, 0, "transformer", FluxTransformer2DModel, FLUX_1_DEV),
    )


flux_kontext = functools.partial(flux, pipeline_class=FluxKontextPipeline)
