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

from rollout_server.families.common.build import Build, merged
from rollout_server.families.common.tokenizers import CORPUS
from rollout_server.families.flux.preset import flux
from rollout_server.families.flux.published import SHAPES
from rollout_server.families.flux.published import TEXT_TOKENS as TEXT_TOKENS  # read by its pretraining

WEIGHTS = Path(__file__).with_name("shapes_weights")
# What examples/pretrain_shapes.py trains; the rest of the pipeline is the seeded build.
TRAINED_COMPONENTS = ("vae", "transformer")


def shapes_corpus() -> str:
    """The tokenizers' training text: the embedded corpus and every caption of the grammar."""
    from rollout_core import scenes

    return CORPUS + "\n".join(scenes.caption(spec) for spec in scenes.all_specs()) + "\n"


def untrained_shapes_pipeline(folder: Path):
    """The seeded pipeline before pretraining; its tokenizers are written into `folder`."""
    return flux(_with_shapes_corpus(Build(Path(folder), SHAPES)))


def load_pretrained(pipe, weights: Path = WEIGHTS) -> None:
    """Loads the trained components (and the VAE's latent scaling and shift) into `pipe`."""
    latents = json.loads((weights / "latents.json").read_text())
    pipe.vae.register_to_config(**latents)
    for name in TRAINED_COMPONENTS:
        getattr(pipe, name).load_state_dict(load_file(weights / f"{name}.safetensors"), strict=True)


def _with_shapes_corpus(target: Build) -> Build:
    corpus = {"corpus": shapes_corpus()}
    return Build(
        target.folder, merged(target.size, {"tokenizer": corpus, "tokenizer_2": corpus}), target.meta
    )


def shapes(target: Build):
    """The pretrained `shapes` preset, a FluxPipeline (``target``'s size: ``SHAPES``)."""
    pipe = flux(_with_shapes_corpus(target))
    load_pretrained(pipe)
    return pipe
