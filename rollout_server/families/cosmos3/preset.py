"""Cosmos3's text-to-video pipeline from its published configs, at a preset's size or the checkpoint's.

Every component is the real diffusers/transformers class with Cosmos3's structure: the dual-pathway
(mixture-of-transformers) Cosmos3OmniTransformer over the prompt's token ids and 2 x 2 patches of
48-channel latents, with grouped key/value heads, qk-norm and interleaved 3D mRoPE; Wan 2.2's 16x
spatial, 4x temporal AutoencoderKLWan (patchified, residual); a byte-level BPE Qwen2 tokenizer with
Qwen3's special tokens (``<|vision_start|>`` among them) and chat template, trained on the pipeline's
system prompts and templates, as Cosmos3's Qwen3-VL tokenizer is a Qwen2 tokenizer; and the
released checkpoints' UniPC scheduler (Karras sigmas on flow sigmas). No safety checker: the
pipeline is saved with ``enable_safety_checker`` off (the checker needs ``cosmos_guardrail``).
"""

from typing import TYPE_CHECKING

from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
from diffusers.pipelines.cosmos import pipeline_cosmos3_omni

from rollout_server.families.common import components
from rollout_server.families.cosmos3.published import COSMOS3_NANO, SCHEDULER_CONFIG, WAN_2_2_VAE

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def template_text() -> str:
    """The words the pipeline adds around a prompt: its system prompts and metadata templates."""
    module = pipeline_cosmos3_omni
    templates = (
        "The video is not 1.0 seconds long and is not of 24 FPS.",
        "This video is not of 64x64 resolution. This image is not of 64x64 resolution.",
    )
    return "\n".join((module._SYSTEM_PROMPT_IMAGE, module._SYSTEM_PROMPT_VIDEO, *templates)) + "\n"


def cosmos3(target: "Build") -> Cosmos3OmniPipeline:
    """A Cosmos3OmniPipeline of Cosmos3-Nano's components, without its safety checker."""
    tokenizer = components.qwen3_tokenizer(target, "text_tokenizer", template_text())
    return Cosmos3OmniPipeline(
        transformer=components.model(
            target, 1, "transformer", Cosmos3OmniTransformer, COSMOS3_NANO, tokenizer
        ),
        text_tokenizer=tokenizer,
        vae=components.model(target, 0, "vae", AutoencoderKLWan, WAN_2_2_VAE),
        scheduler=UniPCMultistepScheduler(**SCHEDULER_CONFIG),
        enable_safety_checker=False,
    )
