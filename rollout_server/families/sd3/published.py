"""Stable Diffusion 3.5 Medium's published configs."""

from rollout_server.families.common.published import FLUX_1_VAE

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
