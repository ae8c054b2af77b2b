"""FLUX.2 [dev] and [klein]'s published configs, and the size of the presets built from them."""

from rollout_server.families.common.build import TOKENIZER_LENGTH
from rollout_server.families.common.published import FLUX_1_SCHEDULER, QWEN3_4B, TINY_KL_VAE, TINY_QWEN3

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
# black-forest-labs/FLUX.2-dev tokenizer (Mistral Small 3.1's): the text length it pads prompts to.
MISTRAL_TOKENIZER = {"model_max_length": 131072}
# black-forest-labs/FLUX.2-dev vae/config.json is AutoencoderKLFlux2's defaults (FLUX.2-klein's too).
FLUX_2_VAE: dict = {}
# black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json: FLUX.1's dynamic shifting, whose mu the
# pipelines compute from the image token count and the step count (compute_empirical_mu), on the
# exponential time shift.
FLUX2_SCHEDULER = {**FLUX_1_SCHEDULER, "time_shift_type": "exponential"}

# The presets, [dev] and [klein] alike. The text encoders have two layers: the adapters stack their three
# hidden states (embeddings and both layers) where FLUX.2 stacks three of 36 or 40 layers, so the
# transformer's joint_attention_dim is three times the encoder's width, as in the real models. Prompts
# are padded to 64 tokens.
TEXT_TOKENS = 64
TINY = {
    "transformer": {
        "num_layers": 1,
        "num_single_layers": 1,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "axes_dims_rope": (4, 4, 4, 4),  # sums to attention_head_dim
        "in_channels": 4 * 4,  # the VAE latents' 2x2 patches
        "joint_attention_dim": 3 * 32,
    },
    "vae": {**TINY_KL_VAE, "latent_channels": 4},
    "tokenizer": {"model_max_length": TEXT_TOKENS},
    # [klein]'s Qwen3.
    "text_encoder": {
        **TINY_QWEN3,
        "intermediate_size": 3 * 32,
        "max_position_embeddings": 4 * TEXT_TOKENS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # [dev]'s Mistral 3 and its Pixtral vision tower.
    "mistral": {
        "text_config": {
            "vocab_size": TOKENIZER_LENGTH,
            "hidden_size": 32,
            "intermediate_size": 3 * 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32 // 2,
            "max_position_embeddings": 4 * TEXT_TOKENS,
            "rope_theta": 10000.0,
            "sliding_window": None,
        },
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 2 * 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 32 // 2,
            "image_size": 64,
            "patch_size": 16,
        },
    },
}
