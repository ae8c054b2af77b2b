"""A seeded, randomly initialised Cosmos3-shaped text-to-video pipeline for tests and benchmarks.

Every component is the real diffusers/transformers class with Cosmos3's structure: the dual-pathway
(mixture-of-transformers) Cosmos3OmniTransformer over the prompt's token ids and 2 x 2 patches of
48-channel latents, with grouped key/value heads, qk-norm and interleaved 3D mRoPE; Wan 2.2's 16x
spatial, 4x temporal AutoencoderKLWan (patchified, residual); a byte-level BPE Qwen2 tokenizer with
Qwen3's special tokens (``<|vision_start|>`` among them) and chat template, trained on the pipeline's
system prompts and templates, as Cosmos3's Qwen3-VL tokenizer is a Qwen2 tokenizer; and the
released checkpoints' UniPC scheduler (Karras sigmas on flow sigmas). No safety checker: the
pipeline is saved with ``enable_safety_checker`` off (the checker needs ``cosmos_guardrail``). Only
the widths, depths and vocabulary are shrunk.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
from diffusers.pipelines.cosmos import pipeline_cosmos3_omni
from transformers import AutoTokenizer

from rollout_server.families.common.tokenizers import (
    QWEN3_CHAT_TEMPLATE,
    QWEN3_SPECIAL_TOKENS,
    write_qwen2_tokenizer,
)


@dataclass(frozen=True)
class Cosmos3PresetConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # grouped: Cosmos3's attention repeats each key/value head
    head_dim: int
    rope_axes_dim: tuple[int, int, int]  # frames, rows, columns: sums to half the head dim
    vae_base_dim: int


COSMOS3_PRESET_CONFIGS = {
    "tiny": Cosmos3PresetConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        # Grouped as Cosmos3-Nano's 32 query and 8 key/value heads (a key/value head per group of
        # query heads), and both counts divide by 2: --sp 2's Ulysses splits each.
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_axes_dim=(2, 3, 3),
        vae_base_dim=8,
    ),
}
LATENT_CHANNELS = 48  # Wan 2.2's VAE, whose 2 x 2 patches the transformer reads (192 per patch)
# diffusers' scripts/convert_cosmos3_to_diffusers.py: the scheduler it saves with the released
# checkpoints, Karras sigmas approximating a flow shift of 5 over 35 steps.
SCHEDULER_CONFIG = {
    "use_karras_sigmas": True,
    "use_flow_sigmas": True,
    "prediction_type": "flow_prediction",
    "sigma_max": 200.0,
    "sigma_min": 0.147,
}


def template_text() -> str:
    """The words the pipeline adds around a prompt: its system prompts and metadata templates."""
    module = pipeline_cosmos3_omni
    templates = (
        "The video is not 1.0 seconds long and is not of 24 FPS.",
        "This video is not of 64x64 resolution. This image is not of 64x64 resolution.",
    )
    return "\n".join((module._SYSTEM_PROMPT_IMAGE, module._SYSTEM_PROMPT_VIDEO, *templates)) + "\n"


def build_cosmos3_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset and saves it as a float32 Cosmos3OmniPipeline into `folder`."""
    cfg = COSMOS3_PRESET_CONFIGS[size]
    folder = Path(folder)
    write_qwen2_tokenizer(
        folder / "text_tokenizer",
        template_text(),
        special_tokens=QWEN3_SPECIAL_TOKENS,
        chat_template=QWEN3_CHAT_TEMPLATE,
    )
    tokenizer = AutoTokenizer.from_pretrained(folder / "text_tokenizer")

    # A fixed seed per component keeps each one stable when another component's config changes.
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=cfg.vae_base_dim,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        is_residual=True,
        in_channels=12,  # 3 colours x 2 x 2 patches
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS,
    )
    torch.manual_seed(1)
    transformer = Cosmos3OmniTransformer(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rope_axes_dim=list(cfg.rope_axes_dim),
        latent_channel=LATENT_CHANNELS,
        latent_patch_size=2,
        patch_latent_dim=4 * LATENT_CHANNELS,
        vocab_size=len(tokenizer),
    )
    pipe = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**SCHEDULER_CONFIG),
        enable_safety_checker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
