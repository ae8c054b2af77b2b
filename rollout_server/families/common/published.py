"""The published configs more than one family's checkpoints ship: shared text encoders and autoencoders.

Every family's published.py holds such values, each under a comment naming the file they come from;
values the diffusers or transformers class defaults to are left out. They are data, read by the
tests and the real-size checks on the meta device (tests/families/test_real_sizes.py).
"""

# black-forest-labs/FLUX.1-dev vae/config.json.
FLUX_1_VAE = {
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 16,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
}
# black-forest-labs/FLUX.1-dev text_encoder/config.json (openai/clip-vit-large-patch14's text model);
# also stabilityai/stable-diffusion-3.5-medium text_encoder/config.json.
CLIP_L = {
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "max_position_embeddings": 77,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "projection_dim": 768,
    "vocab_size": 49408,
}
# black-forest-labs/FLUX.1-dev text_encoder_2/config.json (google/t5-v1_1-xxl's encoder); also
# stabilityai/stable-diffusion-3.5-medium text_encoder_3/config.json.
T5_XXL = {
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "feed_forward_proj": "gated-gelu",
    "num_heads": 64,
    "num_layers": 24,
    "tie_word_embeddings": False,
    "vocab_size": 32128,
}
# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct).
QWEN_VL = {
    "text_config": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 128000,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False,
        "vocab_size": 152064,
    },
    "vision_config": {
        "depth": 32,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
    },
    "tie_word_embeddings": False,
}
# Tongyi-MAI/Z-Image-Turbo and black-forest-labs/FLUX.2-klein-4B text_encoder/config.json: Qwen3-4B's.
QWEN3_4B = {
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
