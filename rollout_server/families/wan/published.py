"""Wan 2.1 and 2.2 text-to-video's published configs."""

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (diffusers' scripts/convert_wan_to_diffusers.py).
WAN_1_3B = {
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "text_dim": 4096,
}
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json; each of Wan-AI/Wan2.2-T2V-A14B-Diffusers's two
# experts (transformer/ and transformer_2/) has the same one.
WAN_14B = {**WAN_1_3B, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}
# Wan-AI/Wan2.1-*-Diffusers vae/config.json is AutoencoderKLWan's defaults (Wan2.1_VAE.pth, as the
# conversion script builds it); text_encoder/config.json is google/umt5-xxl's encoder.
UMT5_XXL = {
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "feed_forward_proj": "gated-gelu",
    "num_heads": 64,
    "num_layers": 24,
    "tie_word_embeddings": False,
    "vocab_size": 256384,
}
