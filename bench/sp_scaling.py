"""Sequence-parallel scaling: seconds per denoising step of the same rollout on servers with SP=1 and
SP=2 (Ulysses over gloo on CPU, NCCL on GPUs), read from each rollout's own timings.

The CPU budget is held fixed where it matters: SP=1 with 2 torch threads against SP=2 with 1 thread
per rank, plus SP=1 with 1 thread as the single-core reference.

    python bench/sp_scaling.py                              # small-flux, 512x512, CPU
    python bench/sp_scaling.py --device cuda --dtype bfloat16 --size 1024
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from rollout.v1 import rollout_pb2
from rollout_client import Finished, RolloutClient
from rollout_core.local_server import LocalServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def seconds_per_step(address: str, request: rollout_pb2.RolloutRequest, repeats: int) -> float:
    with RolloutClient(address, timeout=1800) as client:
        runs = []
        for _ in range(repeats + 1):  # the first run warms up
            finished = next(e for e in client.stream(request) if isinstance(e, Finished))
            runs.append(finished.message.denoise_seconds / request.num_steps)
    return statistics.median(runs[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-flux")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    request = rollout_pb2.RolloutRequest(
        prompts=["a watercolour fox in a misty forest"],
        base_seed=1,
        height=args.size,
        width=args.size,
        num_steps=args.steps,
        latents=rollout_pb2.LATENT_SELECTION_FINAL_ONLY,
        images=False,
    )
    configurations = [(1, 1), (1, 2), (2, 1)] if args.device == "cpu" else [(1, 0), (2, 0)]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        cache = ["--cache-dir", str(args.cache_dir or Path(scratch) / "cache")]
        for sp, threads in configurations:
            server_args = [
                "--model",
                args.model,
                "--sp",
                str(sp),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
            ]
            server_args += ["--threads", str(threads)] if threads else []
            server = LocalServer.start(Path(scratch) / f"sp{sp}-{threads}.log", *server_args, *cache)
            try:
                rows.append((sp, threads, seconds_per_step(server.address, request, args.repeats)))
            finally:
                server.stop()
    baseline = rows[-2][2]  # SP=1 with the same total threads as SP=2
    tokens = (args.size // 16) ** 2
    print(
        f"{args.model}, {args.size}x{args.size} ({tokens} image tokens), {args.steps} steps, {args.device}\n"
    )
    print("| SP | threads per rank | s/step | vs SP=1 same budget |")
    print("|---|---|---|---|")
    for sp, threads, seconds in rows:
        print(f"| {sp} | {threads or '-'} | {seconds:.3f} | {seconds / baseline:.2f}x |")


if __name__ == "__main__":
    main()
