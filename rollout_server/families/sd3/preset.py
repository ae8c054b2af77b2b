"""Seeded, randomly initialised SD3.5-Medium-shaped pipelines for tests and benchmarks.

Every component is the real diffusers/transformers class with SD3.5-Medium's structure (MMDiT-X with dual
attention and RMS qk-norm, 2x2 patches over unpacked 16-channel latents, 8x VAE downsampling, CLIP-L + CLIP-G
pooled and sequence conditioning padded to the T5 width, static-shift flow-matching scheduler); only the
widths, depths and vocabularies are shrunk. Weights are random but seeded, so a preset always produces the
same files and the same images.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5TokenizerFast,
)

from rollout_server.families.common.components import kl_vae, t5_encoder
from rollout_server.families.common.tokenizers import write_clip_tokenizer, write_t5_tokenizer


@dataclass(frozen=True)
class SD3PresetConfig:
    """The knobs that differ between presets; everything else is copied from SD3.5-Medium.

    The pipeline concatenates the CLIP-L and CLIP-G hidden states and zero-pads them to the T5 width, so
    ``t5_d_model`` must be at least ``clip_l_hidden_size + clip_g_hidden_size`` (4096 >= 768 + 1280 in the
    original); the pooled projection is the concatenation of both CLIP projections.
    """

    num_layers: int
    dual_attention_layers: tuple[int, ...]
    num_attention_heads: int
    attention_head_dim: int
    pos_embed_max_size: int
    latent_channels: int
    vae_block_out_channels: tuple[int, int, int, int]
    vae_norm_num_groups: int
    vae_layers_per_block: int
    clip_l_hidden_size: int
    clip_g_hidden_size: int
    clip_layers: int
    clip_heads: int
    clip_vocab_size: int
    t5_d_model: int
    t5_layers: int
    t5_heads: int
    t5_vocab_size: int


SD3_PRESET_CONFIGS = {
    "tiny": SD3PresetConfig(
        num_layers=2,
        dual_attention_layers=(0,),
        num_attention_heads=2,
        attention_head_dim=16,
        # 128 patches of 2x2 latents cover the server's largest side (2048 px); SD3.5-Medium uses 384.
        pos_embed_max_size=128,
        latent_channels=16,
        vae_block_out_channels=(16, 16, 16, 16),
        vae_norm_num_groups=8,
        vae_layers_per_block=1,
        clip_l_hidden_size=32,
        clip_g_hidden_size=48,
        clip_layers=2,
        clip_heads=2,
        clip_vocab_size=768,
        t5_d_model=96,  # wider than 32 + 48, so the CLIP hidden states are padded as in the original
        t5_layers=2,
        t5_heads=2,
        t5_vocab_size=256,
    ),
}

# SD3.5-Medium's scheduler config, verbatim: a static shift, no resolution-dependent shifting.
SD3_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}


def _clip_text_encoder(tokenizer: CLIPTokenizer, hidden_size: int, hidden_act: str, cfg: SD3PresetConfig):
    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=4 * hidden_size,
            projection_dim=hidden_size,
            num_hidden_layers=cfg.clip_layers,
            num_attention_heads=cfg.clip_heads,
            max_position_embeddings=tokenizer.model_max_length,
            hidden_act=hidden_act,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def build_sd3_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset and saves it as a float32 StableDiffusion3Pipeline into `folder`."""
    cfg = SD3_PRESET_CONFIGS[size]
    folder = Path(folder)
    write_clip_tokenizer(folder / "tokenizer", cfg.clip_vocab_size)
    write_clip_tokenizer(folder / "tokenizer_2", cfg.clip_vocab_size)
    write_t5_tokenizer(folder / "tokenizer_3", cfg.t5_vocab_size)
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    tokenizer_2 = CLIPTokenizer.from_pretrained(folder / "tokenizer_2")
    tokenizer_3 = T5TokenizerFast.from_pretrained(folder / "tokenizer_3")

    # A fixed seed per component keeps each one stable when another component's config changes.
    torch.manual_seed(0)
    inner_dim = cfg.num_attention_heads * cfg.attention_head_dim
    transformer = SD3Transformer2DModel(
        sample_size=128,  # the pipeline's default side: 128 latents * 8 = 1024 px
        patch_size=2,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.t5_d_model,
        caption_projection_dim=inner_dim,  # text and image tokens share the joint attention width
        pooled_projection_dim=cfg.clip_l_hidden_size + cfg.clip_g_hidden_size,
        pos_embed_max_size=cfg.pos_embed_max_size,
        dual_attention_layers=cfg.dual_attention_layers,
        qk_norm="rms_norm",
    )

    torch.manual_seed(1)
    vae = kl_vae(cfg, scaling_factor=1.5305, shift_factor=0.0609)

    torch.manual_seed(2)
    text_encoder = _clip_text_encoder(tokenizer, cfg.clip_l_hidden_size, "quick_gelu", cfg)  # CLIP-L
    torch.manual_seed(3)
    text_encoder_2 = _clip_text_encoder(tokenizer_2, cfg.clip_g_hidden_size, "gelu", cfg)  # OpenCLIP bigG

    torch.manual_seed(4)
    text_encoder_3 = t5_encoder(tokenizer_3, cfg)

    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
