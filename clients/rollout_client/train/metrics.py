"""What a run writes besides its policy: metrics.csv's columns (defined here once), the reward and
accuracy plots, sample images, and the shapes eval's tables and grids."""

import functools
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_client.train.rollouts import retrying

if TYPE_CHECKING:
    from PIL import Image

    from rollout_client import RolloutClient, Trajectory
    from rollout_client.rewards import Reward
    from rollout_client.shapes_eval import ShapesEval
    from rollout_client.train.config import TrainConfig

COLUMNS = [
    "iteration",
    "policy_version",
    "pushed_version",
    "reward_mean",
    "reward_std",
    "loss",
    "ratio_max_dev",
    "kl",
    "scored_steps",
    "rollout_seconds",
    "train_seconds",
    "update_seconds",
    "iteration_seconds",
    "eval_accuracy",
    "eval_se",
    "transformer_rows",
    "pruned_leaves",
    "prune_asked",
    "prune_stopped",
    "eval_seconds",
    "policy_grad_norm",
    "anchor_grad_norm",
    "velocity_norm_ratio",
    "eval_accuracy_defaults",
    "eval_se_defaults",
    "eval_accuracy_search",
    "eval_se_search",
    "eval_forwards_search",
    "eval_plain_forwards_search",
    "eval_accuracy_search_defaults",
    "eval_se_search_defaults",
    "eval_forwards_search_defaults",
    "eval_plain_forwards_search_defaults",
]
# A policy's evals, by name: at the training's sampling settings (``eval_accuracy``, ``eval_se``), at the
# server's defaults, and with --search each of those with step-wise search (``eval_accuracy_<name>``,
# ``eval_se_<name>``, and a search's ``eval_forwards_<name>`` beside ``eval_plain_forwards_<name>``).
TRAINING, DEFAULTS, SEARCH, SEARCH_DEFAULTS = "training", "defaults", "search", "search_defaults"
EVAL_LABELS = {
    TRAINING: "at the training's settings",
    DEFAULTS: "at the server's defaults",
    SEARCH: "with step-wise search, at the training's settings",
    SEARCH_DEFAULTS: "with step-wise search, at the server's defaults",
}


def step_reward_column(step: int) -> str:
    """The column of the mean reward of step ``step``'s previews (an algorithm's ``columns()``: Step-GRPO's
    intermediate rewards, one column per preview step of its run)."""
    return f"step_reward_mean/step{step}"


def save_images(trajectories: list["Trajectory"], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for trajectory in trajectories:
        slug = re.sub(r"[^a-z0-9]+", "-", trajectory.prompt.lower()).strip("-")
        name = f"p{trajectory.prompt_index:02d}-s{trajectory.sample_index:03d}-{slug}.png"
        (folder / name).write_bytes(trajectory.image_png)


def plot_rewards(rows: list[dict], reward: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    iterations = [row["iteration"] for row in rows]
    mean = [row["reward_mean"] for row in rows]
    std = [row["reward_std"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=120)
    axis.plot(iterations, mean, marker="o", markersize=3, label="reward mean")
    lower = [m - s for m, s in zip(mean, std, strict=True)]
    upper = [m + s for m, s in zip(mean, std, strict=True)]
    axis.fill_between(iterations, lower, upper, alpha=0.25, label="+/- std")
    axis.set_xlabel("iteration")
    axis.set_ylabel("reward (-JPEG kB / 500)" if reward.endswith(":jpeg_compressibility") else reward)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_accuracy(rows: list[dict], final: tuple[int, float, float], path: Path) -> None:
    """The eval accuracy, +- its standard error, at every evaluated iteration and after the last."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    points = [
        (row["iteration"], row["eval_accuracy"], row["eval_se"])
        for row in rows
        if not math.isnan(row.get("eval_accuracy", math.nan))
    ]
    points.append(final)
    iterations, accuracy, se = zip(*points, strict=True)
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=120)
    axis.errorbar(iterations, accuracy, yerr=se, marker="o", markersize=4, capsize=3)
    axis.set_xlabel("iteration (policy before its update)")
    axis.set_ylabel("strict eval accuracy")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def eval_sheet(result: "ShapesEval", columns: int = 8) -> "Image.Image":
    """The eval images in a contact sheet, each framed green where strictly right and red where wrong."""
    from PIL import ImageOps

    from rollout_client.images import contact_sheet

    framed = [
        ImageOps.expand(image, border=2, fill=(40, 170, 60) if correct else (220, 40, 40))
        for image, correct in zip(result.images, result.correct, strict=True)
    ]
    return contact_sheet(framed, columns)


def eval_grid(result: "ShapesEval", path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    eval_sheet(result).save(path)


def evaluate(client: "RolloutClient", config: "TrainConfig", reward: "Reward") -> dict[str, "ShapesEval"]:
    """The served policy's evals on the shapes task, by name (``TRAINING`` ...): ODE at the training
    size, at its steps and --cfg and at the server's defaults; with --search also step-wise search at
    each, scored by ``reward`` (the run's) on previews."""
    from rollout_client.shapes_eval import at_server_defaults, eval_request, evaluate_policy, evaluate_search

    request = eval_request(
        samples=config.eval.samples,
        steps=config.rollout.steps,
        size=config.rollout.size,
        seed=config.eval.seed,
        true_cfg_scale=config.rollout.cfg,
        prompts=config.eval.prompts,
    )
    requests = {TRAINING: request, DEFAULTS: at_server_defaults(request)}
    evals = {name: functools.partial(evaluate_policy, client, r) for name, r in requests.items()}
    if config.eval.search:
        steps = config.eval.searched_steps
        evals[SEARCH] = functools.partial(evaluate_search, client, request, reward, config.eval.search, steps)
        evals[SEARCH_DEFAULTS] = functools.partial(
            evaluate_search, client, requests[DEFAULTS], reward, config.eval.search, steps
        )
    retries, address = config.server.retries, client.address
    return {name: retrying(f"eval ({name})", run, retries, address) for name, run in evals.items()}


def eval_columns(results: dict[str, "ShapesEval"] | None) -> dict[str, float]:
    """The metrics columns of an iteration's evals (NaN where none ran)."""
    row = {}
    for name in (TRAINING, DEFAULTS, SEARCH, SEARCH_DEFAULTS):
        result = (results or {}).get(name)
        suffix = "" if name == TRAINING else f"_{name}"
        row[f"eval_accuracy{suffix}"] = math.nan if result is None else result.accuracy
        row[f"eval_se{suffix}"] = math.nan if result is None else result.standard_error
        if name in (SEARCH, SEARCH_DEFAULTS):
            row[f"eval_forwards{suffix}"] = math.nan if result is None else result.forwards
            row[f"eval_plain_forwards{suffix}"] = math.nan if result is None else result.plain_forwards
    return row


def record_eval(path: Path, when: str, results: dict[str, "ShapesEval"]) -> dict[str, dict]:
    """Writes each eval's table, its accuracy +- standard error and every image's score into eval.json
    as ``when``: "before" starts the file afresh, "after" is added to what a run (resumed or not) wrote
    before, with the paired difference to "before" (same prompts and seeds). The training settings'
    are at the top (``before``, ``after``, ``images``, ``paired``), each other eval's the same under its
    name (``defaults`` ...). Returns the pairings by eval name."""
    from rollout_client.shapes_eval import paired_difference

    document = json.loads(path.read_text()) if when != "before" and path.exists() else {}
    pairings = {}
    for name, result in results.items():
        tables = document if name == TRAINING else document.setdefault(name, {})
        tables[when] = result.summary()
        tables.setdefault("images", {})[when] = {"prompts": result.prompts, "correct": result.correct}
        if when == "after" and "before" in tables["images"]:
            before = tables["images"]["before"]
            tables["paired"] = paired_difference(
                before["correct"], result.correct, result.prompts, before["prompts"]
            )
            pairings[name] = tables["paired"]
    path.write_text(json.dumps(document, indent=2) + "\n")
    return pairings
