"""Seeded, randomly initialised FLUX.1-dev-shaped pipelines for tests and benchmarks.

Every component is the real diffusers/transformers class with FLUX.1-dev's structure (guidance embedding,
2x2 latent packing, 8x VAE downsampling, CLIP pooled + T5 sequence conditioning, dynamic-shift flow-matching
scheduler); only the widths, depths and vocabularies are shrunk. Weights are random but seeded, so a preset
always produces the same files and the same images. FLUX.1 Kontext dev has FLUX.1-dev's components and
configs, under FluxKontextPipeline (which appends a conditioning image's tokens to the generated ones).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5TokenizerFast,
)

from rollout_server.families.common.components import kl_vae, t5_encoder
from rollout_server.families.common.tokenizers import CORPUS, write_clip_tokenizer, write_t5_tokenizer


@dataclass(frozen=True)
class FluxPresetConfig:
    """The knobs that differ between presets; everything else is copied from FLUX.1-dev.

    Tokenizer vocabulary sizes stay below what the embedded corpus supports (about 1540 CLIP tokens and 484
    SentencePiece pieces), so the configured sizes are the real ones.
    """

    num_layers: int
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, int, int]
    latent_channels: int
    vae_block_out_channels: tuple[int, int, int, int]
    vae_norm_num_groups: int
    vae_layers_per_block: int
    clip_hidden_size: int
    clip_layers: int
    clip_heads: int
    clip_vocab_size: int
    t5_d_model: int
    t5_layers: int
    t5_heads: int
    t5_vocab_size: int


FLUX_PRESET_CONFIGS = {
    "tiny": FluxPresetConfig(
        num_layers=1,
        num_single_layers=1,
        num_attention_heads=2,
        attention_head_dim=16,
        axes_dims_rope=(4, 6, 6),
        latent_channels=4,
        vae_block_out_channels=(16, 16, 16, 16),
        vae_norm_num_groups=8,
        vae_layers_per_block=1,
        clip_hidden_size=32,
        clip_layers=2,
        clip_heads=2,
        clip_vocab_size=768,
        t5_d_model=32,
        t5_layers=2,
        t5_heads=2,
        t5_vocab_size=256,
    ),
    "small": FluxPresetConfig(
        num_layers=2,
        num_single_layers=4,
        num_attention_heads=6,  # divisible by 2 and 3: Ulysses sequence parallelism splits heads
        attention_head_dim=64,
        axes_dims_rope=(16, 24, 24),
        latent_channels=16,
        vae_block_out_channels=(32, 64, 128, 128),
        vae_norm_num_groups=32,
        vae_layers_per_block=1,
        clip_hidden_size=128,
        clip_layers=4,
        clip_heads=4,
        clip_vocab_size=1536,
        t5_d_model=256,
        t5_layers=4,
        t5_heads=4,
        t5_vocab_size=480,
    ),
}

# FLUX.1-dev's scheduler config, verbatim: the timestep shift depends on the image token count.
FLUX_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def build_flux_preset(folder: Path, size: str) -> None:
    """Builds the `size` ("tiny" or "small") preset and saves it as a float32 FluxPipeline into `folder`."""
    flux_pipeline(folder, FLUX_PRESET_CONFIGS[size]).save_pretrained(folder, safe_serialization=True)


def build_flux_kontext_preset(folder: Path, size: str) -> None:
    """Builds the `size` preset's components and saves them as a float32 FluxKontextPipeline into
    `folder`."""
    pipe = flux_pipeline(folder, FLUX_PRESET_CONFIGS[size], pipeline_class=FluxKontextPipeline)
    pipe.save_pretrained(folder, safe_serialization=True)


def flux_pipeline(
    folder: Path,
    cfg: FluxPresetConfig,
    corpus: str = CORPUS,
    text_tokens: int = 512,
    guidance: bool = True,
    pipeline_class: type[FluxPipeline | FluxKontextPipeline] = FluxPipeline,
) -> FluxPipeline | FluxKontextPipeline:
    """A seeded, randomly initialised `pipeline_class` of `cfg`'s sizes, its tokenizers trained on
    `corpus` and written into `folder`; prompts are padded to `text_tokens` T5 tokens, and `guidance`
    says whether the transformer embeds the guidance scale (FLUX.1-dev's guidance distillation)."""
    folder = Path(folder)
    write_clip_tokenizer(folder / "tokenizer", cfg.clip_vocab_size, corpus)
    write_t5_tokenizer(folder / "tokenizer_2", cfg.t5_vocab_size, corpus, text_tokens)
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    tokenizer_2 = T5TokenizerFast.from_pretrained(folder / "tokenizer_2")

    # A fixed seed per component keeps each one stable when another component's config changes.
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * cfg.latent_channels,  # latents are packed into 2x2 patches
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.t5_d_model,
        pooled_projection_dim=cfg.clip_hidden_size,
        guidance_embeds=guidance,
        axes_dims_rope=cfg.axes_dims_rope,
    )

    torch.manual_seed(1)
    vae = kl_vae(cfg, scaling_factor=0.3611, shift_factor=0.1159)

    torch.manual_seed(2)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.clip_hidden_size,
            intermediate_size=4 * cfg.clip_hidden_size,
            projection_dim=cfg.clip_hidden_size,
            num_hidden_layers=cfg.clip_layers,
            num_attention_heads=cfg.clip_heads,
            max_position_embeddings=tokenizer.model_max_length,
            hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )

    torch.manual_seed(3)
    text_encoder_2 = t5_encoder(tokenizer_2, cfg)

    return pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
