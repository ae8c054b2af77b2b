"""Wan 2.1 image-to-video's published configs, and the size of the preset built from them."""

from rollout_server.families.common.build import merged
from rollout_server.families.wan import published as wan
from rollout_server.families.wan.published import WAN_14B

# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer/config.json: the noisy latents, the first-frame mask
# and the first frame's latents in, and cross-attention to CLIP image embeddings.
WAN_I2V_14B = {**WAN_14B, "added_kv_proj_dim": 5120, "image_dim": 1280, "in_channels": 36}
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers image_encoder/config.json (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's
# vision model).
CLIP_VIT_H = {
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "image_size": 224,
    "intermediate_size": 5120,
    "num_attention_heads": 16,
    "num_hidden_layers": 32,
    "patch_size": 14,
    "projection_dim": 1024,
}
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K preprocessor_config.json, Wan-AI/Wan2.1-I2V-14B-480P-Diffusers
# image_processor/: OpenAI CLIP's normalisation, bicubic resize and centre crop to 224.
CLIP_VIT_H_PROCESSOR = {
    "size": {"shortest_edge": 224},
    "crop_size": {"height": 224, "width": 224},
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

# The preset: text-to-video's, with a narrow CLIP vision tower reading 32 x 32 images.
TINY = merged(
    wan.TINY,
    {
        "transformer": {"image_dim": 32, "added_kv_proj_dim": 2 * 24},  # the CLIP width; heads x head dim
        "image_processor": {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}},
        "image_encoder": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,  # the pipeline reads the penultimate layer's states
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,  # 16 patches and the class token
            "projection_dim": 512,  # CLIPVisionModel has no projection: the class default, unread
        },
    },
)
