"""Seeded, randomly initialised Wan 2.1 and 2.2 text-to-video pipelines for tests and benchmarks.

Every component is the real diffusers/transformers class with Wan's structure:
- a WanTransformer3DModel with 1x2x2 patches, 3D RoPE, RMS qk-norm and cross-attention to the text;
- the causal 3D AutoencoderKLWan (8x spatial and 4x temporal downsampling, 16 latent channels with
  Wan's per-channel latents mean and std);
- a UMT5 text encoder with a locally trained SentencePiece tokenizer;
- the UniPC flow-matching scheduler with Wan's flow shift.

Only the widths, depths and vocabulary are shrunk. The "tiny-2.2" size adds Wan 2.2's second expert,
``transformer_2``, which the pipeline runs on the steps whose timestep is below
``boundary_ratio * 1000``. The image-to-video preset builds its components with the same functions.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

from rollout_server.families.common.tokenizers import write_t5_tokenizer


@dataclass(frozen=True)
class WanPresetConfig:
    num_layers: int
    num_attention_heads: int  # divisible by 2: Ulysses sequence parallelism splits heads
    attention_head_dim: int
    ffn_dim: int
    vae_base_dim: int
    vae_num_res_blocks: int
    umt5_d_model: int
    umt5_layers: int
    umt5_heads: int
    umt5_vocab_size: int
    two_experts: bool = False


WAN_PRESET_CONFIGS = {
    "tiny": WanPresetConfig(
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=24,  # 3D RoPE: 8 + 8 dims for height and width, 8 for frames
        ffn_dim=64,
        vae_base_dim=8,
        vae_num_res_blocks=1,
        umt5_d_model=32,
        umt5_layers=1,
        umt5_heads=4,
        umt5_vocab_size=1000,
    ),
}
WAN_PRESET_CONFIGS["tiny-2.2"] = dataclasses.replace(WAN_PRESET_CONFIGS["tiny"], two_experts=True)
# Wan's VAE latent channels (its default latents_mean / latents_std are for 16).
LATENT_CHANNELS = 16
# Wan2.2-T2V-A14B hands the steps below timestep 875 to its low-noise expert.
WAN22_BOUNDARY_RATIO = 0.875
# Wan 2.1 text-to-video: UniPC in flow-prediction mode with shifted flow sigmas.
WAN_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
}


def wan_vae(cfg: WanPresetConfig) -> AutoencoderKLWan:
    """The causal 3D VAE, seeded."""
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=cfg.vae_base_dim,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=cfg.vae_num_res_blocks,
        attn_scales=[],
        temperal_downsample=[False, True, True],  # 4x in time, 8x in space
    )


def wan_transformer(cfg: WanPresetConfig, seed: int, **config) -> WanTransformer3DModel:
    """A denoising transformer seeded with ``seed``; ``config`` adds to or overrides Wan 2.1
    text-to-video's (16 latent channels in and out, cross-attention to the text)."""
    torch.manual_seed(seed)
    return WanTransformer3DModel(
        **{
            "patch_size": (1, 2, 2),
            "num_attention_heads": cfg.num_attention_heads,
            "attention_head_dim": cfg.attention_head_dim,
            "in_channels": LATENT_CHANNELS,
            "out_channels": LATENT_CHANNELS,
            "text_dim": cfg.umt5_d_model,
            "ffn_dim": cfg.ffn_dim,
            "num_layers": cfg.num_layers,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            **config,
        }
    )


def wan_text_encoder(folder: Path, cfg: WanPresetConfig) -> tuple[T5TokenizerFast, UMT5EncoderModel]:
    """The UMT5 encoder, seeded, and its tokenizer, written to ``folder/tokenizer`` and loaded back."""
    write_t5_tokenizer(folder / "tokenizer", cfg.umt5_vocab_size)
    tokenizer = T5TokenizerFast.from_pretrained(folder / "tokenizer")
    torch.manual_seed(2)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=cfg.umt5_d_model,
            d_kv=cfg.umt5_d_model // cfg.umt5_heads,
            d_ff=2 * cfg.umt5_d_model,
            num_layers=cfg.umt5_layers,
            num_heads=cfg.umt5_heads,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    return tokenizer, text_encoder


def build_wan_preset(folder: Path, size: str) -> None:
    """Builds the `size` preset ("tiny", or "tiny-2.2" with two experts) as a float32 WanPipeline."""
    cfg = WAN_PRESET_CONFIGS[size]
    folder = Path(folder)
    # A fixed seed per component keeps each one stable when another component's config changes.
    tokenizer, text_encoder = wan_text_encoder(folder, cfg)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=wan_vae(cfg),
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
        transformer=wan_transformer(cfg, seed=1),
        transformer_2=wan_transformer(cfg, seed=3) if cfg.two_experts else None,
        boundary_ratio=WAN22_BOUNDARY_RATIO if cfg.two_experts else None,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
