"""A seeded, randomly initialised Wan 2.1 image-to-video pipeline for tests and benchmarks.

Every component is the real diffusers/transformers class with Wan 2.1 I2V's structure:
- a WanTransformer3DModel reading 36 input channels (16 noisy latent channels, then 4 of the
  first-frame mask and 16 of the first frame's VAE latents) and predicting the 16 noisy ones, with an
  image embedder and added key/value projections that cross-attend to CLIP image embeddings;
- a CLIP vision encoder, whose penultimate hidden states the pipeline reads, and its image
  processor;
- the VAE, UMT5 text encoder and UniPC scheduler of the text-to-video preset.

Only the widths, depths, vocabulary and CLIP resolution are shrunk.
"""

from pathlib import Path

import torch
from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

from rollout_server.families.wan.preset import (
    LATENT_CHANNELS,
    WAN_PRESET_CONFIGS,
    WAN_SCHEDULER_CONFIG,
    wan_text_encoder,
    wan_transformer,
    wan_vae,
)

CLIP_SIDE = 32  # ViT-H/14 reads 224 x 224
CLIP_VISION_CONFIG = CLIPVisionConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,  # the pipeline reads the penultimate layer's states
    num_attention_heads=2,
    image_size=CLIP_SIDE,
    patch_size=8,  # 16 patches and the class token
    hidden_act="gelu",
)
# OpenAI CLIP's normalisation, bicubic resize and centre crop, at the shrunk side; the PIL backend
# gives the same numbers whether or not torchvision is installed.
CLIP_PROCESSOR_CONFIG = {
    "size": {"shortest_edge": CLIP_SIDE},
    "crop_size": {"height": CLIP_SIDE, "width": CLIP_SIDE},
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def build_wan_i2v_preset(folder: Path, size: str) -> None:
    """Builds the `size` preset ("tiny") as a float32 WanImageToVideoPipeline."""
    cfg = WAN_PRESET_CONFIGS[size]
    folder = Path(folder)
    vae = wan_vae(cfg)
    tokenizer, text_encoder = wan_text_encoder(folder, cfg)
    torch.manual_seed(4)
    image_encoder = CLIPVisionModel(CLIP_VISION_CONFIG)
    transformer = wan_transformer(
        cfg,
        seed=5,
        # The noisy latents, then the mask (one channel per frame of a latent frame) and the first
        # frame's latents.
        in_channels=2 * LATENT_CHANNELS + vae.config.scale_factor_temporal,
        image_dim=CLIP_VISION_CONFIG.hidden_size,
        added_kv_proj_dim=cfg.num_attention_heads * cfg.attention_head_dim,
    )
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
        image_processor=CLIPImageProcessorPil(**CLIP_PROCESSOR_CONFIG),
        image_encoder=image_encoder,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
