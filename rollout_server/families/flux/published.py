"""FLUX.1 [dev] and FLUX.1 Kontext [dev]'s published configs."""

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
