"""Seeded, randomly initialised FLUX.2 [klein]-shaped pipelines for tests and laptops.

Every component is the real diffusers/transformers class with FLUX.2 [klein]'s structure (a
Flux2Transformer2DModel of double- and single-stream blocks with 4-D RoPE and no guidance embedding,
AutoencoderKLFlux2 with its 2x2 patches' batch-norm statistics and 8x downsampling, a Qwen3 text encoder
behind the Qwen3 chat template, byte-level BPE Qwen2 tokenizer, dynamic-shift scheduler); only the
widths, depths and vocabulary are shrunk. The text encoder has two layers: the adapter stacks its
three hidden states (embeddings and both layers) where FLUX.2 [klein] stacks layers 9, 18 and 27 of
36, so the transformer's ``joint_attention_dim`` is three times the encoder's width, as in the real
model. Weights are random but seeded, so a preset always produces the same files and images. The
preset is the CFG-trained base [klein] (``is_distilled`` False).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

from .tokenizers import QWEN3_CHAT_TEMPLATE, QWEN3_SPECIAL_TOKENS, write_qwen2_tokenizer


@dataclass(frozen=True)
class Flux2KleinPresetConfig:
    """The knobs that differ between presets; everything else is FLUX.2 [klein]'s."""

    num_layers: int
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, int, int, int]  # sums to attention_head_dim
    latent_channels: int
    vae_block_out_channels: tuple[int, int, int, int]
    vae_norm_num_groups: int
    vae_layers_per_block: int
    text_hidden_size: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_tokens: int  # the length prompts are padded to (the tokenizer's model_max_length)


FLUX2_KLEIN_PRESET_CONFIGS = {
    "tiny": Flux2KleinPresetConfig(
        num_layers=1,
        num_single_layers=1,
        num_attention_heads=2,
        attention_head_dim=16,
        axes_dims_rope=(4, 4, 4, 4),
        latent_channels=4,
        vae_block_out_channels=(16, 16, 16, 16),
        vae_norm_num_groups=8,
        vae_layers_per_block=1,
        text_hidden_size=32,
        text_layers=2,
        text_heads=2,
        text_kv_heads=1,
        text_tokens=64,
    ),
}
# The hidden states the adapter stacks (text_encoder_out_layers): the embeddings and both layers.
STACKED_TEXT_STATES = 3

# FLUX.2's scheduler settings: dynamic shifting, whose mu the pipeline computes from the image token
# count and the step count (compute_empirical_mu), on the exponential time shift.
FLUX2_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}


def build_flux2_klein_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset and saves it as a float32 Flux2KleinPipeline into `folder`."""
    cfg = FLUX2_KLEIN_PRESET_CONFIGS[size]
    folder = Path(folder)
    # The words of the chat template's turns are single tokens, as in Qwen3's vocabulary.
    write_qwen2_tokenizer(
        folder / "tokenizer",
        "user\nassistant\n",
        special_tokens=QWEN3_SPECIAL_TOKENS,
        chat_template=QWEN3_CHAT_TEMPLATE,
        model_max_length=cfg.text_tokens,
    )
    tokenizer = Qwen2Tokenizer.from_pretrained(folder / "tokenizer")

    # A fixed seed per component keeps each one stable when another component's config changes.
    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * cfg.latent_channels,  # the VAE latents' 2x2 patches
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=STACKED_TEXT_STATES * cfg.text_hidden_size,
        axes_dims_rope=cfg.axes_dims_rope,
        guidance_embeds=False,
    )

    torch.manual_seed(1)
    blocks = len(cfg.vae_block_out_channels)
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=cfg.vae_block_out_channels,
        layers_per_block=cfg.vae_layers_per_block,
        latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.vae_norm_num_groups,
    )
    # A trained VAE's batch-norm statistics of its patches: random here, away from (0, 1), so a
    # decode that skipped them would differ.
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.2 * torch.randn(vae.bn.num_features))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.num_features))

    torch.manual_seed(2)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=cfg.text_hidden_size,
            intermediate_size=3 * cfg.text_hidden_size,
            num_hidden_layers=cfg.text_layers,
            num_attention_heads=cfg.text_heads,
            num_key_value_heads=cfg.text_kv_heads,
            head_dim=cfg.text_hidden_size // cfg.text_heads,
            max_position_embeddings=4 * cfg.text_tokens,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )

    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
