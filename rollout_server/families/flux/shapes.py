"""The `shapes` preset: a FLUX-family pipeline pretrained on the shapes scenes
(`rollout_core.scenes`).

The architecture is FLUX.1-dev's (2x2 latent packing, CLIP pooled + T5 sequence conditioning, the
dynamic-shift flow-matching scheduler) at a size this CPU trains, with three changes the task calls for:
a 4x VAE (64 x 64 images give 16 x 16 latents, 64 transformer tokens), prompts padded to `TEXT_TOKENS`
T5 tokens (the longest caption fits), and no guidance embedding (the model is not guidance-distilled;
classifier-free guidance is the true-CFG path). The tokenizers are trained on the embedded corpus plus
every caption of the grammar, so each word of a caption is a token or two.

The text encoders and tokenizers are built here, seeded, and stay as initialised; the VAE and the
transformer are trained by `examples/pretrain_shapes.py`, whose weights, command, seed and sha256 are
committed in `shapes_weights/` next to this file.
"""

import json
from pathlib import Path

from safetensors.torch import load_file

from rollout_server.families.common.tokenizers import CORPUS
from rollout_server.families.flux.preset import FluxPresetConfig, flux_pipeline

SHAPES_CONFIG = FluxPresetConfig(
    num_layers=2,
    num_single_layers=2,
    num_attention_heads=4,  # divisible by 2 and 4: Ulysses sequence parallelism splits heads
    attention_head_dim=32,
    axes_dims_rope=(8, 12, 12),
    latent_channels=4,
    vae_block_out_channels=(16, 32, 32),
    vae_norm_num_groups=8,
    vae_layers_per_block=1,
    clip_hidden_size=64,
    clip_layers=2,
    clip_heads=2,
    clip_vocab_size=768,
    t5_d_model=64,
    t5_layers=2,
    t5_heads=2,
    t5_vocab_size=256,
)
TEXT_TOKENS = 24  # the longest caption is 18 T5 tokens with its end token
WEIGHTS = Path(__file__).with_name("shapes_weights")
# What examples/pretrain_shapes.py trains; the rest of the pipeline is the seeded build.
TRAINED_COMPONENTS = ("vae", "transformer")


def shapes_corpus() -> str:
    """The tokenizers' training text: the embedded corpus and every caption of the grammar."""
    from rollout_core import scenes

    return CORPUS + "\n".join(scenes.caption(spec) for spec in scenes.all_specs()) + "\n"


def untrained_shapes_pipeline(folder: Path):
    """The seeded pipeline before pretraining; its tokenizers are written into `folder`."""
    return flux_pipeline(folder, SHAPES_CONFIG, shapes_corpus(), TEXT_TOKENS, guidance=False)


def load_pretrained(pipe, weights: Path = WEIGHTS) -> None:
    """Loads the trained components (and the VAE's latent scaling and shift) into `pipe`."""
    latents = json.loads((weights / "latents.json").read_text())
    pipe.vae.register_to_config(**latents)
    for name in TRAINED_COMPONENTS:
        getattr(pipe, name).load_state_dict(load_file(weights / f"{name}.safetensors"), strict=True)


def build_shapes_preset(folder: Path, size: str) -> None:
    """Builds the pretrained `shapes` preset (`size`: "pretrained") as a float32 FluxPipeline in `folder`."""
    pipe = untrained_shapes_pipeline(folder)
    load_pretrained(pipe)
    pipe.save_pretrained(folder, safe_serialization=True)
