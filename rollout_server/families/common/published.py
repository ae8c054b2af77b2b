"""The published configs more than one family's checkpoints ship: shared text encoders and autoencoders.

Every family's published.py holds such values, each under a comment naming the file they come from;
values the diffusers or transformers class defaults to are left out. They are data, read by the
builders (a preset: these with a size's overrides; a real-size check: these alone, on the meta device).
"""

from rollout_server.families.common.build import TOKENIZER_LENGTH

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
# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json: the timestep shift depends on the image
# token count (FLUX.2's adds its exponential time shift).
FLUX_1_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
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
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
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
        "tokens_per_second": 2,
        "window_size": 112,
    },
    "tie_word_embeddings": False,
}
# Qwen/Qwen2.5-VL-7B-Instruct tokenizer_config.json: the text length a pipeline that reads it pads to.
QWEN_VL_TOKENIZER = {"model_max_length": 131072}
# A preset's Qwen language model (Qwen2.5-VL's, Qwen3's): two narrow layers of grouped heads over its
# tokenizer's vocabulary.
TINY_QWEN = {
    "vocab_size": TOKENIZER_LENGTH,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
# A preset's Qwen2.5-VL language model: that one with a 4x MLP, its multimodal RoPE sections summing to
# half the head dim.
TINY_QWEN_VL_TEXT = {
    **TINY_QWEN,
    "intermediate_size": 4 * 32,
    "rope_parameters": {"mrope_section": [2, 3, 3]},
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
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
# Qwen/Qwen3-4B tokenizer_config.json: the text length a pipeline that reads it pads prompts to.
QWEN3_TOKENIZER = {"model_max_length": 131072}
# A preset's Qwen3 text encoder: the tiny Qwen language model, its head dim in its config.
TINY_QWEN3 = {**TINY_QWEN, "head_dim": 32 // 2}
# openai/clip-vit-large-patch14's tokenizer (also OpenCLIP bigG's): the size of its BPE vocabulary.
CLIP_TOKENIZER = {"vocab_size": 49408}
# google/t5-v1_1-xxl's tokenizer: the pieces of its spiece.model (its 100 <extra_id_*> sentinels beside them).
T5_TOKENIZER = {"vocab_size": 32000}


def clip_size(width: int, layers: int, heads: int) -> dict:
    """A scaled-down CLIP text encoder: ``layers`` of ``width`` (a 4x MLP, a projection as wide) over its
    tokenizer's vocabulary."""
    return {
        "vocab_size": TOKENIZER_LENGTH,
        "hidden_size": width,
        "intermediate_size": 4 * width,
        "projection_dim": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
    }


def t5_size(width: int, layers: int, heads: int) -> dict:
    """A scaled-down T5 v1.1 encoder: ``layers`` of ``width`` (t5-v1_1-xxl's 2.5x gated MLP: 4096 -> 10240)
    over its tokenizer's vocabulary."""
    return {
        "vocab_size": TOKENIZER_LENGTH,
        "d_model": width,
        "d_kv": width // heads,
        "d_ff": int(2.5 * width),
        "num_layers": layers,
        "num_heads": heads,
    }


# A preset's KL autoencoder (FLUX.1's layout): one narrow layer a level.
TINY_KL_VAE = {"block_out_channels": (16, 16, 16, 16), "norm_num_groups": 8, "layers_per_block": 1}
# A preset's CLIP text encoder, its tokenizer trained to 768 tokens.
TINY_CLIP_TOKENIZER = {"vocab_size": 768}
TINY_CLIP = clip_size(32, layers=2, heads=2)
