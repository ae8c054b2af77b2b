"""Z-Image-Turbo's published configs, and the size of the preset built from them."""

from rollout_server.families.common.published import TINY_KL_VAE, TINY_QWEN3

# Tongyi-MAI/Z-Image-Turbo transformer/config.json.
Z_IMAGE_TURBO = {
    "all_f_patch_size": [1],
    "all_patch_size": [2],
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560,
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}
# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a static shift of 3 (the pipeline passes its
# resolution shift mu, which a statically shifted scheduler does not read).
Z_IMAGE_SCHEDULER = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}

# The preset: every transformer stack keeps at least two blocks, as Z-Image's do (the context-parallel
# plan splits a stack at its first block and gathers at its last); FLUX.1's VAE narrowed.
TINY = {
    "transformer": {
        "dim": 32,
        "n_layers": 2,
        "n_heads": 2,
        "n_kv_heads": 2,
        "axes_dims": [4, 6, 6],  # sums to the head dim, dim / n_heads
        "axes_lens": [1024, 512, 512],
        "cap_feat_dim": 32,  # the text encoder's width
    },
    "vae": TINY_KL_VAE,
    "text_encoder": {**TINY_QWEN3, "intermediate_size": 2 * 32, "tie_word_embeddings": False},
}
