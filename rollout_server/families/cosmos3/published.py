"""Cosmos3's published configs."""

# nvidia/Cosmos3-Nano transformer/config.json, the arguments Cosmos3OmniTransformer takes (the file
# also carries the source model's, e.g. "model_type": "qwen3_vl_text" and "use_moe", which diffusers
# ignores): Qwen3-VL-8B's text model (36 layers of 4096, 32 query and 8 key/value heads of 128) with
# a second, generation pathway in every layer, and its action and sound heads.
COSMOS3_NANO = {
    "action_dim": 64,
    "action_gen": True,
    "base_fps": 24,
    "enable_fps_modulation": True,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "latent_channel": 48,
    "latent_patch_size": 2,
    "num_attention_heads": 32,
    "num_embodiment_domains": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "patch_latent_dim": 192,
    "qk_norm_for_text": True,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000,
    "sound_dim": 64,
    "sound_gen": True,
    "sound_latent_fps": 25,
    "timestep_scale": 0.001,
    "unified_3d_mrope_reset_spatial_ids": True,
    "unified_3d_mrope_temporal_modality_margin": 15000,
    "vocab_size": 151936,
}
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json, the VAE diffusers' convert_cosmos3_to_diffusers.py
# saves with Cosmos3 (its 48 latents_mean and latents_std values change no size: zeros and ones here).
WAN_2_2_VAE = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "latents_mean": [0.0] * 48,
    "latents_std": [1.0] * 48,
}
