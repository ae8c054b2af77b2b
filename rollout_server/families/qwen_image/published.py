"""Qwen-Image and Qwen-Image-Edit's published configs."""

# Qwen/Qwen-Image transformer/config.json; Qwen/Qwen-Image-Edit ships the same one.
QWEN_IMAGE = {
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
}
# Qwen/Qwen-Image vae/config.json (its default latents_mean and latents_std are the class's).
QWEN_IMAGE_VAE = {
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}
# Qwen2.5-VL-7B-Instruct preprocessor_config.json, the image processor of Qwen/Qwen-Image-Edit.
QWEN_VL_PROCESSOR = {
    "merge_size": 2,
    "max_pixels": 12845056,
    "min_pixels": 3136,
    "patch_size": 14,
    "temporal_patch_size": 2,
}
