"""FLUX.1 [dev] and FLUX.1 Kontext [dev]'s published configs, and the sizes of the presets built from them."""

from rollout_server.families.common.published import (
    TINY_CLIP,
    TINY_CLIP_TOKENIZER,
    TINY_KL_VAE,
    clip_size,
    t5_size,
)

# black-forest-labs/FLUX.1-dev transformer/config.json; FLUX.1-Kontext-dev ships the same one.
FLUX_1_DEV = {
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
# black-forest-labs/FLUX.1-dev tokenizer_2/tokenizer_config.json: prompts are padded to this length.
FLUX_T5_TOKENS = 512
# The presets: FLUX.1-dev with fewer and narrower layers, 8x VAE downsampling kept. The tokenizers' sizes
# stay below what the embedded corpus supports (about 1540 CLIP tokens and 484 SentencePiece pieces), so
# they are the real ones; each text encoder's vocabulary is its tokenizer's.
TINY = {
    "transformer": {
        "num_layers": 1,
        "num_single_layers": 1,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "axes_dims_rope": (4, 6, 6),
        "in_channels": 4 * 4,  # 4 latent channels packed into 2x2 patches
        "joint_attention_dim": 32,  # the T5 width
        "pooled_projection_dim": 32,  # the CLIP width
    },
    "vae": {**TINY_KL_VAE, "latent_channels": 4},
    "tokenizer": TINY_CLIP_TOKENIZER,
    "text_encoder": TINY_CLIP,
    "tokenizer_2": {"vocab_size": 256},
    "text_encoder_2": t5_size(32, layers=2, heads=2),
}
SMALL = {
    "transformer": {
        "num_layers": 2,
        "num_single_layers": 4,
        "num_attention_heads": 6,  # divisible by 2 and 3: Ulysses sequence parallelism splits heads
        "attention_head_dim": 64,
        "axes_dims_rope": (16, 24, 24),
        "in_channels": 4 * 16,
        "joint_attention_dim": 256,
        "pooled_projection_dim": 128,
    },
    "vae": {"block_out_channels": (32, 64, 128, 128), "layers_per_block": 1},
    "tokenizer": {"vocab_size": 1536},
    "text_encoder": clip_size(128, layers=4, heads=4),
    "tokenizer_2": {"vocab_size": 480},
    "text_encoder_2": t5_size(256, layers=4, heads=4),
}
TEXT_TOKENS = 24  # the longest caption is 18 T5 tokens with its end token
# The `shapes` preset (shapes.py): FLUX.1-dev at a size this CPU trains, with three VAE levels (4x) and
# no guidance embedding.
SHAPES = {
    "transformer": {
        "num_layers": 2,
        "num_single_layers": 2,
        "num_attention_heads": 4,  # divisible by 2 and 4: Ulysses sequence parallelism splits heads
        "attention_head_dim": 32,
        "axes_dims_rope": (8, 12, 12),
        "in_channels": 4 * 4,
        "joint_attention_dim": 64,
        "pooled_projection_dim": 64,
        "guidance_embeds": False,
    },
    "vae": {
        "latent_channels": 4,
        "block_out_channels": (16, 32, 32),
        "down_block_types": ("DownEncoderBlock2D",) * 3,
        "up_block_types": ("UpDecoderBlock2D",) * 3,
        "norm_num_groups": 8,
        "layers_per_block": 1,
    },
    "tokenizer": {"vocab_size": 768},
    "text_encoder": clip_size(64, layers=2, heads=2),
    "tokenizer_2": {"vocab_size": 256, "model_max_length": TEXT_TOKENS},
    "text_encoder_2": t5_size(64, layers=2, heads=2),
}
