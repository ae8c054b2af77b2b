"""SD3.5-Medium's pipeline from its published configs, at a preset's size or the checkpoint's.

Every component is the real diffusers/transformers class with SD3.5-Medium's structure (MMDiT-X with dual
attention and RMS qk-norm, 2x2 patches over unpacked 16-channel latents, 8x VAE downsampling, CLIP-L + CLIP-G
pooled and sequence conditioning padded to the T5 width, static-shift flow-matching scheduler).
"""

from typing import TYPE_CHECKING

from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextModelWithProjection

from rollout_server.families.common import components
from rollout_server.families.common.published import CLIP_L, T5_XXL
from rollout_server.families.sd3.published import CLIP_G, SD3_SCHEDULER, SD35_MEDIUM, SD35_VAE

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def sd3(target: "Build") -> StableDiffusion3Pipeline:
    """A StableDiffusion3Pipeline of SD3.5-Medium's components."""
    return StableDiffusion3Pipeline(
        transformer=components.model(target, 0, "transformer", SD3Transformer2DModel, SD35_MEDIUM),
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
        vae=components.model(target, 1, "vae", AutoencoderKL, SD35_VAE),
        **components.clip_text(target, 2, CLIPTextModelWithProjection, CLIP_L),
        # OpenCLIP bigG's
        **components.clip_text(
            target, 3, CLIPTextModelWithProjection, CLIP_G, ("tokenizer_2", "text_encoder_2")
        ),
        **components.t5_text(target, 4, T5_XXL, ("tokenizer_3", "text_encoder_3")),
    )
