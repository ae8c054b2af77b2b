"""FLUX.2 [dev] and [klein]'s published configs."""

from rollout_server.families.common.published import QWEN3_4B

# black-forest-labs/FLUX.2-dev transformer/config.json (diffusers' scripts/convert_flux2_to_diffusers.py).
FLUX_2_DEV = {
    "attention_head_dim": 128,
    "axes_dims_rope": [32, 32, 32, 32],
    "eps": 1e-6,
    "in_channels": 128,
    "joint_attention_dim": 15360,
    "mlp_ratio": 3.0,
    "num_attention_heads": 48,
    "num_layers": 8,
    "num_single_layers": 48,
    "patch_size": 1,
    "rope_theta": 2000,
    "timestep_guidance_channels": 256,
}
# FLUX.2 [klein] 4B and 9B (the same script): no guidance embedding, narrower and shallower.
FLUX_2_KLEIN_4B = {
    **FLUX_2_DEV,
    "guidance_embeds": False,
    "joint_attention_dim": 7680,
    "num_attention_heads": 24,
    "num_layers": 5,
    "num_single_layers": 20,
}
FLUX_2_KLEIN_9B = {
    **FLUX_2_DEV,
    "guidance_embeds": False,
    "joint_attention_dim": 12288,
    "num_attention_heads": 32,
    "num_layers": 8,
    "num_single_layers": 24,
}
# black-forest-labs/FLUX.2-klein-9B text_encoder/config.json: Qwen3-8B's.
QWEN3_8B = {
    **QWEN3_4B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "tie_word_embeddings": False,
}
# black-forest-labs/FLUX.2-dev text_encoder/config.json: Mistral Small 3.1 24B's (its Pixtral vision
# tower beside the language model).
MISTRAL_SMALL_3_1 = {
    "image_token_index": 10,
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "vocab_size": 131072,
    },
    "vision_config": {
        "head_dim": 64,
        "hidden_size": 1024,
        "image_size": 1540,
        "intermediate_size": 4096,
        "model_type": "pixtral",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "rope_theta": 10000.0,
    },
    "vision_feature_layer": -1,
}
