"""Seeded, randomly initialised Z-Image-shaped pipelines for tests and benchmarks.

Every component is the real diffusers/transformers class with Z-Image's structure (a single-stream DiT
whose image and caption tokens go through refiner blocks of their own before the joint layers, 3-D
RoPE, 2x2 patches over unpacked 16-channel latents; FLUX.1's 8x VAE; a Qwen3 text encoder behind
Qwen3's chat template, with a byte-level BPE Qwen2 tokenizer; a statically shifted flow-matching
scheduler, as Z-Image-Turbo's); only the widths, depths and vocabulary are shrunk. Weights are random but
seeded, so a preset always produces the same files and images.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Model

from rollout_server.families.common.components import kl_vae, qwen3_config, qwen3_tokenizer


@dataclass(frozen=True)
class ZImagePresetConfig:
    """The knobs that differ between presets; everything else is ZImageTransformer2DModel's defaults
    (Z-Image's patch sizes, norms, RoPE theta and timestep scale).

    Every transformer stack keeps at least two blocks, as Z-Image's do: the context-parallel plan
    splits a stack at its first block and gathers at its last.
    """

    dim: int
    n_layers: int
    n_refiner_layers: int
    n_heads: int
    axes_dims: tuple[int, int, int]  # sums to the head dim, dim / n_heads
    latent_channels: int
    vae_block_out_channels: tuple[int, int, int, int]
    vae_norm_num_groups: int
    vae_layers_per_block: int
    text_hidden_size: int  # also the transformer's cap_feat_dim
    text_layers: int
    text_heads: int
    text_kv_heads: int


Z_IMAGE_PRESET_CONFIGS = {
    "tiny": ZImagePresetConfig(
        dim=32,
        n_layers=2,
        n_refiner_layers=2,
        n_heads=2,
        axes_dims=(4, 6, 6),
        latent_channels=16,
        vae_block_out_channels=(16, 16, 16, 16),
        vae_norm_num_groups=8,
        vae_layers_per_block=1,
        text_hidden_size=32,
        text_layers=2,
        text_heads=2,
        text_kv_heads=1,
    ),
}

# A static shift of 3, as Z-Image-Turbo's scheduler (the pipeline passes its resolution shift mu, which
# a statically shifted scheduler does not read).
Z_IMAGE_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}
# FLUX.1's VAE latent normalisation, which Z-Image uses.
VAE_SCALING_FACTOR, VAE_SHIFT_FACTOR = 0.3611, 0.1159


def build_z_image_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset and saves it as a float32 ZImagePipeline into `folder`."""
    folder = Path(folder)
    cfg = Z_IMAGE_PRESET_CONFIGS[size]
    # The tokenizer learns the template's words, rendered around an empty prompt, as whole tokens.
    template = "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    tokenizer = qwen3_tokenizer(folder / "tokenizer", template)

    # A fixed seed per component keeps each one stable when another component's config changes.
    torch.manual_seed(0)
    vae = kl_vae(cfg, VAE_SCALING_FACTOR, VAE_SHIFT_FACTOR)

    torch.manual_seed(1)
    transformer = ZImageTransformer2DModel(
        in_channels=cfg.latent_channels,
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_refiner_layers=cfg.n_refiner_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        cap_feat_dim=cfg.text_hidden_size,
        axes_dims=list(cfg.axes_dims),
    )

    torch.manual_seed(2)
    text_encoder = Qwen3Model(
        qwen3_config(
            tokenizer,
            cfg,
            intermediate_size=2 * cfg.text_hidden_size,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    )

    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
