"""Seeded, randomly initialised FLUX.2-shaped pipelines for tests and laptops: [klein] and [dev].

Every component is the real diffusers/transformers class with FLUX.2's structure (a
Flux2Transformer2DModel of double- and single-stream blocks with 4-D RoPE, AutoencoderKLFlux2 with its
2x2 patches' batch-norm statistics and 8x downsampling, a dynamic-shift scheduler); only the widths,
depths and vocabularies are shrunk. [klein] has a Qwen3 text encoder behind the Qwen3 chat template, no
guidance embedding, and is the CFG-trained base (``is_distilled`` False); [dev] has a Mistral3 text
encoder (Mistral Small 3.1's, with its Pixtral vision tower) behind Mistral's chat template, and embeds
the guidance scale.

The text encoders have two layers: the adapters stack their three hidden states (embeddings and both
layers) where FLUX.2 stacks three of 36 or 40 layers, so the transformer's ``joint_attention_dim`` is
three times the encoder's width, as in the real models. [dev]'s tokenizer is a tokenizer, not the
Mistral processor a real checkpoint ships (Pixtral's image processor beside the tokenizer), which
transformers builds only with torchvision; Flux2Pipeline's text-only prompt encoding reads the tokenizer
alone. Weights are random but seeded, so a preset always produces the same files and images.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen3ForCausalLM,
)

from rollout_server.families.common.components import qwen3_config, qwen3_tokenizer
from rollout_server.families.common.tokenizers import write_mistral_tokenizer


@dataclass(frozen=True)
class Flux2PresetConfig:
    """The knobs that differ between presets; everything else is FLUX.2's."""

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


FLUX2_PRESET_CONFIGS = {
    "tiny": Flux2PresetConfig(
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
# The hidden states the adapters stack (text_encoder_out_layers): the embeddings and both layers.
STACKED_TEXT_STATES = 3

# FLUX.2's scheduler settings: dynamic shifting, whose mu the pipelines compute from the image token
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
    cfg = FLUX2_PRESET_CONFIGS[size]
    folder = Path(folder)
    # The words of the chat template's turns are single tokens, as in Qwen3's vocabulary.
    tokenizer = qwen3_tokenizer(folder / "tokenizer", "user\nassistant\n", cfg.text_tokens)
    transformer, vae = transformer_and_vae(cfg, guidance=False)

    torch.manual_seed(2)
    text_encoder = Qwen3ForCausalLM(
        qwen3_config(
            tokenizer,
            cfg,
            intermediate_size=3 * cfg.text_hidden_size,
            max_position_embeddings=4 * cfg.text_tokens,
            tie_word_embeddings=True,
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


def build_flux2_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset and saves it as a float32 Flux2Pipeline (FLUX.2 [dev]) into `folder`."""
    cfg = FLUX2_PRESET_CONFIGS[size]
    folder = Path(folder)
    # The words of the pipeline's system message are single tokens, as in Mistral's vocabulary.
    write_mistral_tokenizer(folder / "tokenizer", SYSTEM_MESSAGE, model_max_length=cfg.text_tokens)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    transformer, vae = transformer_and_vae(cfg, guidance=True)

    torch.manual_seed(2)
    heads = cfg.text_heads
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config={
                "model_type": "mistral",
                "vocab_size": len(tokenizer),
                "hidden_size": cfg.text_hidden_size,
                "intermediate_size": 3 * cfg.text_hidden_size,
                "num_hidden_layers": cfg.text_layers,
                "num_attention_heads": heads,
                "num_key_value_heads": cfg.text_kv_heads,
                "head_dim": cfg.text_hidden_size // heads,
                "max_position_embeddings": 4 * cfg.text_tokens,
                "rms_norm_eps": 1e-5,
                "sliding_window": None,
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
            },
            vision_config={
                "model_type": "pixtral",
                "hidden_size": cfg.text_hidden_size,
                "intermediate_size": 2 * cfg.text_hidden_size,
                "num_hidden_layers": 1,
                "num_attention_heads": heads,
                "head_dim": cfg.text_hidden_size // heads,
                "image_size": 64,
                "patch_size": 16,
            },
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        )
    )

    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def transformer_and_vae(
    cfg: Flux2PresetConfig, guidance: bool
) -> tuple[Flux2Transformer2DModel, AutoencoderKLFlux2]:
    """FLUX.2's seeded transformer (embedding the guidance scale or not) and VAE of `cfg`'s sizes."""
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
        guidance_embeds=guidance,
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
    return transformer, vae
