"""Wan 2.1 image-to-video's published configs."""

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
