"""End to end in under a minute on a laptop CPU: serve the pretrained ``shapes`` preset, roll out 2
prompts of its scene grammar x 4 samples with ``rollout-client`` (the stochastic sampler, with the
preset's true CFG),
then replay one saved trajectory's log-probs the way a trainer does, with the transformer loaded by
plain diffusers, and compare them with the streamed ones. contact-sheet.png has a row per prompt,
labelled with it.

    python examples/demo.py --out demo-output
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

from rollout_client import RolloutClient, Trajectory, replay_log_probs
from rollout_core.local_server import LocalServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the server builds its model locally

MODEL = "shapes"
PROMPTS = ["a red circle to the left of a blue square", "two yellow triangles"]
SAMPLES_PER_PROMPT = 4
BASE_SEED = 2024
REPLAYED_SAMPLE = 5  # the second sample of the second prompt
TOLERANCE = 1e-5  # fp32 replay parity (docs/design.md, invariant 1)


def replay(model_path: Path, trajectory_path: Path) -> float:
    """Print streamed vs replayed log-probs of one trajectory; return the largest difference."""
    from diffusers import FluxTransformer2DModel  # the trainer's side; the client library never imports it

    transformer = FluxTransformer2DModel.from_pretrained(model_path / "transformer").eval()
    trajectory = Trajectory.load(trajectory_path)
    replayed = replay_log_probs(transformer, trajectory)
    print(f"\nreplay of {trajectory_path.name} (prompt {trajectory.prompt!r}, seed {trajectory.seed})")
    print(f"{'step':>4}  {'streamed':>12}  {'replayed':>12}  {'|diff|':>9}")
    differences = []
    for i in trajectory.stochastic.nonzero().flatten().tolist():
        streamed, again = trajectory.log_probs[i].item(), replayed[i].item()
        differences.append(abs(streamed - again))
        print(f"{i:>4}  {streamed:>12.7f}  {again:>12.7f}  {differences[-1]:>9.2e}")
    return max(differences)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("demo-output"), help="output folder")
    parser.add_argument("--cache-dir", type=Path, default=None, help="model preset cache of the server")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    # One torch thread: the tiny model gains nothing from more, and they would contend with the client.
    cache = ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    server = LocalServer.start(args.out / "server.log", "--model", MODEL, "--threads", "1", *cache)
    address = server.address
    try:
        with RolloutClient(address, timeout=60) as client:
            info = client.server_info()
        print(f"serving {info.model} ({info.family}, {info.dtype} on {info.device}) at {address}")
        group = ["--samples-per-prompt", str(SAMPLES_PER_PROMPT), "--seed", str(BASE_SEED)]
        rollout_client = [sys.executable, "-m", "rollout_client.cli", "rollout", "--address", address]
        subprocess.run([*rollout_client, *PROMPTS, *group, "--out", args.out], check=True, timeout=120)
        worst = replay(Path(info.model_path), args.out / f"sample-{REPLAYED_SAMPLE}.safetensors")
    finally:
        returncode = server.stop()
    if returncode != 0:
        raise SystemExit(f"server exited with {returncode}; see {args.out / 'server.log'}")
    print(f"server stopped cleanly; largest |diff| {worst:.2e}; see {args.out / 'contact-sheet.png'}")
    if worst > TOLERANCE:
        raise SystemExit(f"replayed log-probs differ from the streamed ones by {worst:.2e} > {TOLERANCE}")


if __name__ == "__main__":
    main()
