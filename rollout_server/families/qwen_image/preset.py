"""Seeded, randomly initialised Qwen-Image-shaped pipelines for tests and benchmarks.

Every component is the real diffusers/transformers class with Qwen-Image's structure (MMDiT over 2x2-packed
latents with 3-D RoPE, 8x video VAE with per-channel latent statistics, a Qwen2.5-VL text encoder behind the
chat prompt template, byte-level BPE Qwen2 tokenizer, dynamic-shift scheduler); only the widths, depths and
vocabulary are shrunk. Weights are random but seeded, so a preset always produces the same files and images.
Qwen-Image-Edit has Qwen-Image's components under QwenImageEditPipeline, its tokenizer trained on the edit
template, and the Qwen2-VL processor that feeds the conditioning image to the text encoder's vision tower.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
)
from transformers.utils import is_torchvision_available

from rollout_server.families.common.tokenizers import write_qwen2_tokenizer


@dataclass(frozen=True)
class QwenImagePresetConfig:
    """The knobs that differ between presets; everything else is copied from Qwen-Image."""

    num_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, int, int]
    vae_base_dim: int
    vae_num_res_blocks: int
    text_hidden_size: int  # also the transformer's joint_attention_dim
    text_layers: int
    text_heads: int
    text_kv_heads: int
    mrope_section: tuple[int, int, int]  # sums to half the text head dim
    vision_hidden_size: int
    vision_depth: int
    vision_heads: int


QWEN_IMAGE_PRESET_CONFIGS = {
    "tiny": QwenImagePresetConfig(
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=16,
        axes_dims_rope=(4, 6, 6),
        vae_base_dim=8,
        vae_num_res_blocks=1,
        text_hidden_size=32,
        text_layers=2,
        text_heads=2,
        text_kv_heads=1,
        mrope_section=(2, 3, 3),
        vision_hidden_size=32,
        vision_depth=2,
        vision_heads=2,
    ),
}

# Qwen-Image's scheduler config, verbatim: the timestep shift depends on the image token count.
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}


# Qwen2.5-VL's image processor (14-pixel patches merged 2x2 into one token, OpenAI CLIP's normalisation),
# whose pixel bounds keep a tiny preset's images at their size (to the nearest 28 pixels), up to
# 448 x 448 (256 tokens). Saved as a Qwen2VLImageProcessor: loading picks the backend.
QWEN_VL_PROCESSOR_CONFIG = {
    "patch_size": 14,  # Qwen2.5-VL's vision config default, which the presets keep
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 28 * 28 * 4,
    "max_pixels": 28 * 28 * 256,
}


def _prompt_template(pipeline_class: type[QwenImagePipeline | QwenImageEditPipeline]) -> str:
    """The installed pipeline's prompt template, read off an empty pipeline (__init__ sets it)."""
    components, _ = pipeline_class._get_signature_keys(pipeline_class)
    return pipeline_class(**dict.fromkeys(components)).prompt_template_encode.format("")


def build_qwen_image_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset and saves it as a float32 QwenImagePipeline into `folder`."""
    pipe = QwenImagePipeline(
        **qwen_image_components(folder, QWEN_IMAGE_PRESET_CONFIGS[size], QwenImagePipeline)
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def build_qwen_image_edit_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset's components and saves them as a float32 QwenImageEditPipeline into
    `folder`, with the processor that tokenizes the edit template and cuts the image into patches."""
    if not is_torchvision_available():
        # Qwen2VLProcessor requires a video processor, which transformers has only with torchvision.
        raise ImportError(f"the {size} Qwen-Image-Edit preset needs torchvision: its Qwen2VLProcessor does")
    components = qwen_image_components(folder, QWEN_IMAGE_PRESET_CONFIGS[size], QwenImageEditPipeline)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**QWEN_VL_PROCESSOR_CONFIG),
        tokenizer=components["tokenizer"],
    )
    pipe = QwenImageEditPipeline(**components, processor=processor)
    pipe.save_pretrained(folder, safe_serialization=True)


def qwen_image_components(
    folder: Path, cfg: QwenImagePresetConfig, pipeline_class: type[QwenImagePipeline | QwenImageEditPipeline]
) -> dict:
    """Seeded, randomly initialised Qwen-Image components of `cfg`'s sizes, by pipeline component name;
    the tokenizer is trained on `pipeline_class`'s prompt template and written into `folder`."""
    folder = Path(folder)
    write_qwen2_tokenizer(folder / "tokenizer", _prompt_template(pipeline_class))
    tokenizer = Qwen2Tokenizer.from_pretrained(folder / "tokenizer")

    # A fixed seed per component keeps each one stable when another component's config changes.
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=cfg.vae_base_dim,
        z_dim=16,  # the default per-channel latents_mean / latents_std are Qwen-Image's 16 channels
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=cfg.vae_num_res_blocks,
        attn_scales=[],
        temperal_downsample=[False, True, True],  # vae_scale_factor 2 ** 3 = 8
    )

    torch.manual_seed(1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * vae.config.z_dim,  # latents are packed into 2x2 patches
        out_channels=vae.config.z_dim,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.text_hidden_size,
        guidance_embeds=False,
        axes_dims_rope=cfg.axes_dims_rope,
    )

    torch.manual_seed(2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": cfg.text_hidden_size,
                "intermediate_size": 4 * cfg.text_hidden_size,
                "num_hidden_layers": cfg.text_layers,
                "num_attention_heads": cfg.text_heads,
                "num_key_value_heads": cfg.text_kv_heads,
                "max_position_embeddings": 128000,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": list(cfg.mrope_section),
                },
                "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                "eos_token_id": tokenizer.eos_token_id,
            },
            vision_config={
                "depth": cfg.vision_depth,
                "hidden_size": cfg.vision_hidden_size,
                "intermediate_size": 2 * cfg.vision_hidden_size,
                "num_heads": cfg.vision_heads,
                "out_hidden_size": cfg.text_hidden_size,
                "fullatt_block_indexes": [cfg.vision_depth - 1],
                "tokens_per_second": 2,
            },
            image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        )
    )

    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
