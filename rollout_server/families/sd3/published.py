"""Stable Diffusion 3.5 Medium's published configs, and the size of the preset built from them."""

from rollout_server.families.common.published import (
    FLUX_1_VAE,
    TINY_CLIP,
    TINY_CLIP_TOKENIZER,
    TINY_KL_VAE,
    clip_size,
    t5_size,
)

# stabilityai/stable-diffusion-3.5-medium transformer/config.json.
SD35_MEDIUM = {
    "attention_head_dim": 64,
    "caption_projection_dim": 1536,
    "dual_attention_layers": list(range(13)),
    "in_channels": 16,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 24,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "qk_norm": "rms_norm",
    "sample_size": 128,
}
# stabilityai/stable-diffusion-3.5-medium vae/config.json: FLUX.1's autoencoder layout, its own scale.
SD35_VAE = {**FLUX_1_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
# stabilityai/stable-diffusion-3.5-medium text_encoder_2/config.json (OpenCLIP ViT-bigG/14's text model).
CLIP_G = {
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "max_position_embeddings": 77,
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "projection_dim": 1280,
    "vocab_size": 49408,
}
# stabilityai/stable-diffusion-3.5-medium scheduler/scheduler_config.json: a static shift, no
# resolution-dependent shifting.
SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}

# The preset: SD3.5-Medium's MMDiT-X narrowed and shortened, CLIP-L and CLIP-G 32 and 48 wide. The
# pipeline concatenates the CLIP hidden states and zero-pads them to the T5 width, so that stays at least
# their sum (4096 >= 768 + 1280 in the original); the pooled projection is both CLIP projections.
TINY = {
    "transformer": {
        "num_layers": 2,
        "dual_attention_layers": (0,),
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        # 128 patches of 2x2 latents cover the server's largest side (2048 px); SD3.5-Medium uses 384.
        "pos_embed_max_size": 128,
        "joint_attention_dim": 96,  # the T5 width
        "caption_projection_dim": 2 * 16,  # text and image tokens share the joint attention width
        "pooled_projection_dim": 32 + 48,
    },
    "vae": TINY_KL_VAE,
    "tokenizer": TINY_CLIP_TOKENIZER,
    "text_encoder": TINY_CLIP,
    "tokenizer_2": TINY_CLIP_TOKENIZER,
    "text_encoder_2": clip_size(48, layers=2, heads=2),
    "tokenizer_3": {"vocab_size": 256},
    # T5 wider than the CLIPs together (32 + 48), so their hidden states are padded as in the original.
    "text_encoder_3": t5_size(96, layers=2, heads=2),
}
