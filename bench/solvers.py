"""Deterministic solvers: final-latent error against forwards per rollout, and what a multistep solver
buys a MixGRPO-style rollout.

Per model, from the same prompt and seeds:

* ``ode``: every step deterministic, for euler, dpmpp_2m and unipc at 6, 8, 10 and 16 steps of the
  family's schedule. Printed: the transformer forwards per sample (``RolloutFinished
  .transformer_rows`` over the samples), the final latents' relative RMS distance to a 50-step unipc
  rollout (the highest order here), and the denoising seconds.
* ``window``: FLOW_SDE on the first two steps (1 -> 0.9 -> 0.8, a trainer-supplied schedule, so
  each run draws the same eps at steps 0 and 1 and reaches the same x_2), then K deterministic steps
  of the solver down to 0. Against the same window followed by 48 unipc steps: the error of euler and
  of dpmpp_2m at each K, and for each target error the fewest forwards each needs.

    python bench/solvers.py                                 # tiny-flux, tiny-wan and small-flux
    python bench/solvers.py --models tiny-flux --size 128
"""

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from rollout.v1 import rollout_pb2
from rollout_client import Finished, RolloutClient, Started, Step
from rollout_core import solvers
from rollout_core.local_server import LocalServer

STEPS = (6, 8, 10, 16)
REFERENCE_STEPS = 50
WINDOW = [1.0, 0.9, 0.8]  # the SDE window's sigmas: steps 0 and 1
PROMPTS = ["a red fox in the snow", "a lighthouse at dusk"]


def run(client: RolloutClient, args: argparse.Namespace, **fields) -> tuple[torch.Tensor, float, float]:
    """(final latents, forwards per sample, denoising seconds) of one rollout."""
    request = rollout_pb2.RolloutRequest(
        prompts=PROMPTS,
        samples_per_prompt=2,
        base_seed=7,
        height=args.size,
        width=args.size,
        latents=rollout_pb2.LATENT_SELECTION_FINAL_ONLY,
        images=False,
        **fields,
    )
    final = started = finished = None
    for event in client.stream(request):
        if isinstance(event, Started):
            started = event.message
        elif isinstance(event, Step) and event.x_next is not None:
            final = event.x_next
        elif isinstance(event, Finished):
            finished = event.message
    samples = len(started.seeds)
    return final.double(), finished.transformer_rows / samples, finished.denoise_seconds


def distance(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()


def solver_enum(name: str) -> int:
    return solvers.SOLVERS[name].enum


def ode_table(client: RolloutClient, args: argparse.Namespace) -> None:
    ode = {"sampler": rollout_pb2.SAMPLER_TYPE_ODE}
    reference, *_ = run(client, args, num_steps=REFERENCE_STEPS, solver=solver_enum("unipc"), **ode)
    print("| solver | steps | forwards per sample | error to 50-step unipc | denoise s |")
    print("|---|---|---|---|---|")
    for name in solvers.SOLVERS:
        for steps in STEPS:
            final, forwards, seconds = run(client, args, num_steps=steps, solver=solver_enum(name), **ode)
            print(f"| {name} | {steps} | {forwards:.0f} | {distance(final, reference):.2e} | {seconds:.2f} |")


def window_schedule(tail_steps: int) -> list[float]:
    """The SDE window's sigmas, then ``tail_steps`` equal steps from its end down to 0."""
    end = WINDOW[-1]
    return WINDOW + [end * (1 - k / tail_steps) for k in range(1, tail_steps + 1)]


def window_table(client: RolloutClient, args: argparse.Namespace) -> None:
    sde = {"sampler": rollout_pb2.SAMPLER_TYPE_FLOW_SDE, "stochastic_steps": [0, 1]}
    reference, *_ = run(client, args, sigmas=window_schedule(48), solver=solver_enum("unipc"), **sde)
    errors: dict[str, list[tuple[float, float]]] = {}
    print("\n| solver after the window | K | forwards per sample | error to window + 48 unipc |")
    print("|---|---|---|---|")
    for name in ("euler", "dpmpp_2m"):
        for tail in (4, 6, 8, 12, 16, 24):
            final, forwards, _ = run(
                client, args, sigmas=window_schedule(tail), solver=solver_enum(name), **sde
            )
            error = distance(final, reference)
            errors.setdefault(name, []).append((forwards, error))
            print(f"| {name} | {tail} | {forwards:.0f} | {error:.2e} |")
    print("\n| target error | euler: fewest forwards | dpmpp_2m: fewest forwards |")
    print("|---|---|---|")
    for target in sorted({error for _, error in errors["euler"]}, reverse=True):
        fewest = {
            name: min((forwards for forwards, error in runs if error <= target), default=None)
            for name, runs in errors.items()
        }
        print(f"| {target:.2e} | {fewest['euler']:.0f} | {fewest['dpmpp_2m'] or float('nan'):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny-flux,tiny-wan,small-flux")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as logs:
            options = ("--model", model, "--threads", str(args.threads), "--device", args.device)
            server = LocalServer.start(Path(logs) / "server.log", *options)
            try:
                with RolloutClient(server.address, timeout=3600) as client:
                    print(f"\n## {model} at {args.size} x {args.size}\n")
                    run(client, args, num_steps=2)  # warm-up
                    ode_table(client, args)
                    window_table(client, args)
            finally:
                server.stop()


if __name__ == "__main__":
    main()
