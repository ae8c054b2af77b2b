"""Wan 2.1 and 2.2 text-to-video's published configs, and the size of the presets built from them."""

from rollout_server.families.common.build import TOKENIZER_LENGTH
from rollout_server.families.common.published import T5_XXL

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
# conversion script builds it): 16 latent channels, 4x in time, 8x in space.
WAN_VAE: dict = {}
# Wan-AI/Wan2.1-*-Diffusers text_encoder/config.json: google/umt5-xxl's encoder, T5 v1.1 XXL's layout
# over its larger vocabulary.
UMT5_XXL = {**T5_XXL, "vocab_size": 256384}
# google/umt5-xxl's tokenizer: the pieces of its spiece.model.
UMT5_TOKENIZER = {"vocab_size": 256000}
# Wan-AI/Wan2.2-T2V-A14B-Diffusers model_index.json: the steps below timestep 875 go to its low-noise
# expert.
WAN22_BOUNDARY_RATIO = 0.875
# Wan-AI/Wan2.1-T2V-*-Diffusers scheduler/scheduler_config.json: UniPC in flow-prediction mode with
# shifted flow sigmas.
WAN_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
}

# The presets (Wan 2.1's one expert, Wan 2.2's two, and image-to-video's): one narrow block.
TINY = {
    "transformer": {
        "num_layers": 1,
        "num_attention_heads": 2,  # divisible by 2: Ulysses sequence parallelism splits heads
        "attention_head_dim": 24,  # 3D RoPE: 8 + 8 dims for height and width, 8 for frames
        "ffn_dim": 64,
        "text_dim": 32,  # the UMT5 width
    },
    "vae": {"base_dim": 8, "num_res_blocks": 1},
    "tokenizer": {"vocab_size": 1000},
    "text_encoder": {
        "vocab_size": TOKENIZER_LENGTH,
        "d_model": 32,
        "d_kv": 32 // 4,
        "d_ff": 2 * 32,
        "num_layers": 1,
        "num_heads": 4,
    },
}
