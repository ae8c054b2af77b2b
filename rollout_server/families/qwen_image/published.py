"""Qwen-Image and Qwen-Image-Edit's published configs, and the size of the presets built from them."""

from rollout_server.families.common.published import TINY_QWEN_VL_TEXT

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
# Qwen/Qwen-Image scheduler/scheduler_config.json: the timestep shift depends on the image token count.
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

# The presets: narrow layers; the VL processor's pixel bounds keep a preset's conditioning images at their
# size (to the nearest 28 pixels), up to 448 x 448 (256 tokens).
TINY = {
    "vae": {"base_dim": 8, "num_res_blocks": 1},
    "transformer": {
        "num_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "axes_dims_rope": (4, 6, 6),
        "joint_attention_dim": 32,  # the text encoder's width
    },
    "text_encoder": {
        "text_config": TINY_QWEN_VL_TEXT,
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 2 * 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "fullatt_block_indexes": [1],
        },
    },
    "processor": {"max_pixels": 28 * 28 * 256},
}
