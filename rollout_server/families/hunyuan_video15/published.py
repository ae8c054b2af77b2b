"""HunyuanVideo 1.5's published configs."""

# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v transformer/config.json (the "480p_t2v"
# entry of diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py, which wrote it). Its VAE is
# AutoencoderKLHunyuanVideo15's defaults (the script builds it so), its scheduler shifts by 5 and its
# guider's scale is 6 (the script's 480p_t2v entries, the preset's values).
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
