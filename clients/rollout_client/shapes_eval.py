"""GenEval-style evaluation of a served policy on the shapes task.

Each eval prompt (``rewards.scenes.eval_prompts()``) is sampled ``samples`` times with the
deterministic ODE sampler from fixed seeds (``seed`` + k for the k-th image), at the policy the server
serves now, and every image is scored strictly: the right objects, counts, colours and relation, and
nothing extra. The same call before and after training compares the same noise.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout.v1 import rollout_pb2
from rollout_client.rewards import scenes, shapes

if TYPE_CHECKING:
    from PIL import Image

    from rollout_client.client import RolloutClient


@dataclass(frozen=True)
class ShapesEval:
    """A policy's eval: the table per task type (``rewards.shapes.accuracy_table``) and its images."""

    table: dict[str, tuple[int, int]]
    prompts: list[str]
    images: "list[Image.Image]"
    correct: list[bool]

    @property
    def accuracy(self) -> float:
        correct, total = self.table["overall"]
        return correct / total


def eval_request(
    *, samples: int = 1, steps: int = 20, size: int = 64, seed: int = 0, true_cfg_scale: float | None = None
) -> rollout_pb2.RolloutRequest:
    """The eval rollout: every eval prompt, ``samples`` ODE images each, without latents. CFG is the
    server's default unless ``true_cfg_scale`` is given (the shapes preset's: 3, against the empty
    prompt)."""
    return rollout_pb2.RolloutRequest(
        request_id="eval-shapes",
        prompts=scenes.eval_prompts(),
        samples_per_prompt=samples,
        base_seed=seed,
        num_steps=steps,
        height=size,
        width=size,
        sampler=rollout_pb2.SAMPLER_TYPE_ODE,
        latents=rollout_pb2.LATENT_SELECTION_NONE,
        true_cfg_scale=true_cfg_scale,
    )


def evaluate_policy(client: "RolloutClient", request: rollout_pb2.RolloutRequest | None = None) -> ShapesEval:
    """Roll out ``request`` (default: ``eval_request()``) and score every image strictly."""
    trajectories = client.rollout(request if request is not None else eval_request())
    images = [trajectory.image() for trajectory in trajectories]
    prompts = [trajectory.prompt for trajectory in trajectories]
    correct = shapes.strict_accuracy(images, prompts).bool().tolist()
    return ShapesEval(shapes.accuracy_table(prompts, correct), prompts, images, correct)
