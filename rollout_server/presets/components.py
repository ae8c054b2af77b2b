"""Components FLUX.1 and SD3 share, shrunk: the KL autoencoder and the T5 v1.1 text encoder."""

from diffusers import AutoencoderKL
from transformers import T5Config, T5EncoderModel


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
