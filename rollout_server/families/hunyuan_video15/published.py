"""HunyuanVideo 1.5's published configs, and the size of the preset built from them."""

from rollout_server.families.common.published import TINY_QWEN_VL_TEXT

# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v transformer/config.json (the "480p_t2v"
# entry of diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py, which wrote it). Its VAE is
# AutoencoderKLHunyuanVideo15's defaults (the script builds it so), its scheduler shifts by 5 and its
# guider's scale is 6 (the script's 480p_t2v entries).
HUNYUAN_VIDEO15_480P_T2V = {
    "attention_head_dim": 128,
    "image_embed_dim": 1152,
    "in_channels": 65,
    "num_attention_heads": 16,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "out_channels": 32,
    "rope_axes_dim": (16, 56, 56),
    "target_size": 640,
    "task_type": "t2v",
    "text_embed_2_dim": 1472,
    "text_embed_dim": 3584,
}
# google/byt5-small config.json, the ByT5 encoder of HunyuanVideo 1.5 (Glyph-SDXL-v2's weights; the
# color and font tokens it adds to the vocabulary change no size the adapter reads).
BYT5_SMALL = {
    "d_ff": 3584,
    "d_kv": 64,
    "d_model": 1472,
    "feed_forward_proj": "gated-gelu",
    "num_heads": 6,
    "num_layers": 12,
    "tie_word_embeddings": False,
    "vocab_size": 384,
}
HUNYUAN_VIDEO15_VAE: dict = {}
# A static shift (no resolution-dependent mu): the pipeline passes linspace(1, 0, N + 1)[:-1] as sigmas.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 5.0}
GUIDANCE_SCALE = 6.0

# The preset: one narrow block, the VAE's real widths / 16 (five levels, the last 2C wide).
TINY = {
    "vae": {"block_out_channels": (8, 16, 32, 64, 64), "layers_per_block": 1},
    "transformer": {
        "num_attention_heads": 2,  # divisible by 2: Ulysses sequence parallelism splits heads
        "attention_head_dim": 16,
        "num_layers": 1,
        "num_refiner_layers": 1,
        "text_embed_dim": 32,  # the text encoders' widths
        "text_embed_2_dim": 32,
        "image_embed_dim": 16,
        "rope_axes_dim": (4, 6, 6),  # frames, rows, columns: sums to the head dim
        "target_size": 64,
    },
    # At least 3 layers: the pipeline reads the hidden states 2 layers before the last.
    "text_encoder": {**TINY_QWEN_VL_TEXT, "num_hidden_layers": 3, "max_position_embeddings": 2048},
    "text_encoder_2": {"d_model": 32, "d_kv": 32 // 2, "d_ff": 2 * 32, "num_layers": 1, "num_heads": 2},
}
