"""The KL autoencoder layout FLUX.1 and SD3 share, shrunk: 4 down blocks keep the 8x downsampling."""

from diffusers import AutoencoderKL


def kl_vae(cfg, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """A randomly initialised (seed it first) AutoencoderKL with the preset's widths and the family's
    latent scaling and shift."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
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
