"""Components several presets share, shrunk: the KL autoencoder and the T5 v1.1 text encoder (FLUX.1,
SD3, Z-Image's VAE), and Qwen3's tokenizer and text-encoder config (FLUX.2 [klein], Z-Image)."""

from pathlib import Path

from diffusers import AutoencoderKL
from transformers import Qwen2Tokenizer, Qwen3Config, T5Config, T5EncoderModel

from rollout_server.families.common.tokenizers import (
    QWEN3_CHAT_TEMPLATE,
    QWEN3_SPECIAL_TOKENS,
    write_qwen2_tokenizer,
)


def kl_vae(cfg, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """A randomly initialised (seed it first) AutoencoderKL with the preset's widths and the family's
    latent scaling and shift; one down block per width (4 keep FLUX's and SD3's 8x downsampling)."""
    blocks = len(cfg.vae_block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=cfg.vae_block_out_channels,
        layers_per_block=cfg.vae_layers_per_block,
        act_fn="silu",
        latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.vae_norm_num_groups,
        sample_size=1024,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        force_upcast=True,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    )


def t5_encoder(tokenizer, cfg) -> T5EncoderModel:
    """A randomly initialised (seed it first) T5 v1.1-style encoder (gated GELU, untied embeddings)."""
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=cfg.t5_d_model,
            d_kv=cfg.t5_d_model // cfg.t5_heads,
            d_ff=int(2.5 * cfg.t5_d_model),  # t5-v1_1-xxl: 4096 -> 10240
            num_layers=cfg.t5_layers,
            num_heads=cfg.t5_heads,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


def qwen3_tokenizer(folder: Path, extra_text: str, model_max_length: int = 131072) -> Qwen2Tokenizer:
    """Qwen3's tokenizer, written into ``folder`` and loaded back: Qwen2's byte-level BPE with Qwen3's
    reasoning markers and chat template, the words of ``extra_text`` (the template's) single tokens."""
    write_qwen2_tokenizer(
        folder,
        extra_text,
        special_tokens=QWEN3_SPECIAL_TOKENS,
        chat_template=QWEN3_CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    return Qwen2Tokenizer.from_pretrained(folder)


def qwen3_config(tokenizer: Qwen2Tokenizer, cfg, **more) -> Qwen3Config:
    """A Qwen3 text encoder's config of the preset's text sizes (``text_hidden_size``, ``text_layers``,
    ``text_heads``, ``text_kv_heads``) over ``tokenizer``'s vocabulary and markers; ``more`` sets the
    rest."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.text_hidden_size,
        num_hidden_layers=cfg.text_layers,
        num_attention_heads=cfg.text_heads,
        num_key_value_heads=cfg.text_kv_heads,
        head_dim=cfg.text_hidden_size // cfg.text_heads,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **more,
    )
