"""Z-Image-Turbo's pipeline from its published configs, at a preset's size or the checkpoint's.

Every component is the real diffusers/transformers class with Z-Image's structure (a single-stream DiT
whose image and caption tokens go through refiner blocks of their own before the joint layers, 3-D
RoPE, 2x2 patches over unpacked 16-channel latents; FLUX.1's 8x VAE; a Qwen3 text encoder behind
Qwen3's chat template, with a byte-level BPE Qwen2 tokenizer; a statically shifted flow-matching
scheduler, as Z-Image-Turbo's).
"""

from typing import TYPE_CHECKING

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Model

from rollout_server.families.common import components
from rollout_server.families.common.published import FLUX_1_VAE, QWEN3_4B
from rollout_server.families.z_image.published import Z_IMAGE_SCHEDULER, Z_IMAGE_TURBO

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build

# The words of the chat template, rendered around an empty prompt: the tokenizer learns them as whole tokens.
TEMPLATE = "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"


def z_image(target: "Build") -> ZImagePipeline:
    """A ZImagePipeline of Z-Image-Turbo's components (FLUX.1's VAE, a Qwen3-4B text encoder)."""
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER),
        vae=components.model(target, 0, "vae", AutoencoderKL, FLUX_1_VAE),
        **components.qwen3_text(target, 2, Qwen3Model, QWEN3_4B, TEMPLATE),
        transformer=components.model(target, 1, "transformer", ZImageTransformer2DModel, Z_IMAGE_TURBO),
    )
