"""Step-wise search against plain sampling and best-of-N on the shapes task, paired on the same 256
held-out images as the RL bench's eval (64 eval prompts x 4 seeds from --eval-seed 2024, 64 x 64), on
the pretrained shapes model, at the RL runs' sampling settings (8 steps) and at the server's defaults.

For each setting: plain ODE sampling (``shapes_eval.evaluate_policy``); step-wise search of K (default
4) at --search-steps (``shapes_eval.evaluate_search``: the best of K children by --reward on their
previews at each of those steps, SDE there and ODE elsewhere); and best-of-N plain samples by the same
reward (``evaluate_best_of``) for the N on either side of the search's forwards over plain's, so one
spends at most and one at least as many transformer rows as the search (plain sampling is best-of-1).
Printed: a markdown table per setting (accuracy +- its clustered standard error, the paired difference
to plain sampling and to the search +- its paired standard error, transformer rows per image, wall
seconds), one row per method; --plot draws accuracy against wall seconds. The results are kept in
--out/search.json: a method already there is not run again, so the bench resumes where it stopped.

The reward the search and best-of-N keep the best by is the shapes task's GenEval-style reward, whose
detector also scores the eval: they are tuned to the metric, an upper bound on what a reward model
that only approximates it buys.

    python bench/shapes_search.py --out shapes-search --plot shapes-search.png
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout_client import RolloutClient
from rollout_client.shapes_eval import (
    ShapesEval,
    at_server_defaults,
    eval_request,
    evaluate_best_of,
    evaluate_policy,
    evaluate_search,
    paired_difference,
)
from rollout_client.train.config import parse_search_steps
from rollout_client.train.rewards import Rewards
from rollout_core.local_server import LocalServer

SETTINGS = ("training", "defaults")  # the RL runs' 8 steps and CFG, and the server's defaults


def measured(run) -> dict:
    """``run()``'s eval as JSON, with its wall seconds."""
    start = time.perf_counter()
    result: ShapesEval = run()
    return result.summary() | {
        "seconds": time.perf_counter() - start,
        "prompts": result.prompts,
        "correct": result.correct,
    }


def methods(client, request, reward, k: int, steps: list[int], results: dict, save) -> None:
    """Each method of one setting into ``results`` (skipping those already there), saved after each."""
    if "plain" not in results:
        results["plain"] = measured(lambda: evaluate_policy(client, request))
        save()
    search = f"search-{k}"
    if search not in results:
        results[search] = measured(lambda: evaluate_search(client, request, reward, k, steps))
        save()
    forwards, plain_forwards = results[search]["forwards"], results[search]["plain_forwards"]
    ratio = forwards / plain_forwards
    for n in sorted({n for n in (math.floor(ratio), math.ceil(ratio)) if n >= 2}):  # best-of-1 is plain
        if f"best-of-{n}" not in results:
            results[f"best-of-{n}"] = measured(
                lambda n=n: evaluate_best_of(client, request, reward, n, plain_forwards)
            )
            save()
    results["plain"].setdefault("plain_forwards", plain_forwards)


def print_table(setting: str, results: dict, k: int) -> None:
    plain, search = results["plain"], results[f"search-{k}"]
    images = len(plain["correct"])
    print(f"\n{setting}: {images} images, accuracy in %, differences in points, paired on the same images\n")
    print("| method | accuracy | vs plain | vs search | transformer rows per image | wall s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        rows = r.get("forwards", plain["plain_forwards"]) / images
        cells = []
        for other in (plain, search):
            if r is other:
                cells.append("")
                continue
            paired = paired_difference(other["correct"], r["correct"], r["prompts"], other["prompts"])
            cells.append(f"{100 * paired['difference']:+.1f} +- {100 * paired['se']:.1f}")
        accuracy = f"{100 * r['accuracy']['mean']:.1f} +- {100 * r['accuracy']['se']:.1f}"
        print(f"| {name} | {accuracy} | {cells[0]} | {cells[1]} | {rows:.1f} | {r['seconds']:.0f} |")


def plot(all_results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, len(all_results), figsize=(5.5 * len(all_results), 3.8), dpi=120)
    for axis, (setting, results) in zip(list(axes), all_results.items(), strict=True):
        for name, r in results.items():
            accuracy = r["accuracy"]
            axis.errorbar(
                r["seconds"],
                100 * accuracy["mean"],
                yerr=100 * accuracy["se"],
                marker="o",
                capsize=3,
                label=name,
            )
        axis.set_xlabel("wall seconds for the 256 images (this CPU)")
        axis.set_ylabel("held-out strict accuracy (%)")
        axis.set_title(setting)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("shapes-search"))
    parser.add_argument("--server", help="a running shapes server (default: start one)")
    parser.add_argument("--k", type=int, default=4, help="children per searched step")
    parser.add_argument("--search-steps", type=parse_search_steps, default="0,2,4")
    parser.add_argument("--reward", default="rollout_client.rewards.shapes:geneval_reward")
    parser.add_argument("--steps", type=int, default=8, help="the training setting's steps")
    parser.add_argument("--samples", type=int, default=4, help="images per eval prompt")
    parser.add_argument("--eval-seed", type=int, default=2024)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server we start")
    parser.add_argument("--plot", type=Path, help="write the figure here")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "search.json"
    everything = json.loads(path.read_text()) if path.exists() else {}

    def save() -> None:
        path.write_text(json.dumps(everything, indent=1) + "\n")

    server = None
    if args.server is None:
        # Wide limits: a search tree is admitted at its full width, samples x K^m leaves.
        server = LocalServer.start(
            args.out / "server.log", "--model", "shapes", "--threads", str(args.threads),
            "--max-running-samples", "1024", "--max-tree-nodes", "8192", "--prune-hold-seconds", "600",
        )  # fmt: skip
    try:
        with RolloutClient(args.server or server.address, timeout=1200) as client:
            request = eval_request(samples=args.samples, steps=args.steps, size=64, seed=args.eval_seed)
            requests = {"training": request, "defaults": at_server_defaults(request)}
            reward = Rewards(args.reward)
            for setting in SETTINGS:
                results = everything.setdefault(setting, {})
                print(f"{setting}: running what is not in {path}", file=sys.stderr, flush=True)
                methods(client, requests[setting], reward, args.k, args.search_steps, results, save)
    finally:
        if server is not None:
            server.stop()
    for setting in SETTINGS:
        print_table(setting, everything[setting], args.k)
    if args.plot:
        plot(everything, args.plot)


if __name__ == "__main__":
    main()
