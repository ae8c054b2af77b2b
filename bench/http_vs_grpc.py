"""One 4-sample rollout three ways: (a) in-process through the runner and sampler (nothing encoded,
no images), (b) over the gRPC stream to a client that reads every message, (c) over SGLang's
``POST /rollout/generate`` on the same server's HTTP port (one msgpack body, read to its last byte).
(b) and (c) ask for the same thing: every latent, the env and the decoded images, the same seeds.

Prints a Markdown table: the median time to the last byte of each, its ratio to (a), and the bytes
each transport carried. Runs the three alternately so machine noise hits them alike.

    python bench/http_vs_grpc.py                    # small-flux
    python bench/http_vs_grpc.py --preset tiny-flux
"""

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stream_overhead import in_process_runner, in_process_seconds

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient
from rollout_core.local_server import LocalServer
from rollout_server.validation import resolve

PROMPT = "a watercolour fox in a misty forest"
SEED = 7
SAMPLES = 4


def grpc_request(steps: int) -> rollout_pb2.RolloutRequest:
    return rollout_pb2.RolloutRequest(
        prompts=[PROMPT],
        samples_per_prompt=SAMPLES,
        seeds=[SEED + k for k in range(SAMPLES)],  # SGLang's numbering of its outputs
        num_steps=steps,
        sampler=rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
        noise_level=0.7,
        latents=rollout_pb2.LATENT_SELECTION_ALL,
        images=True,
    )


def http_body(steps: int) -> dict:
    return {
        "prompt": PROMPT,
        "seed": SEED,
        "num_outputs_per_prompt": SAMPLES,
        "num_inference_steps": steps,
        "rollout_sde_type": "sde",
        "rollout_noise_level": 0.7,
        "rollout_return_denoising_env": True,
        "rollout_return_dit_trajectory": True,
    }


def grpc_seconds(client: RolloutClient, request: rollout_pb2.RolloutRequest) -> tuple[float, int]:
    """To the last message of the raw stream, and the bytes of its messages."""
    begin = time.perf_counter()
    size = sum(message.ByteSize() for message in client.stub.Rollout(request, timeout=600))
    return time.perf_counter() - begin, size


def http_seconds(url: str, body: dict) -> tuple[float, int]:
    """To the last byte of the answer, and the bytes of its body."""
    begin = time.perf_counter()
    answer = httpx.post(f"{url}/rollout/generate", json=body, timeout=600)
    answer.raise_for_status()
    return time.perf_counter() - begin, len(answer.content)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small-flux")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        cache_dir = args.cache_dir or Path(scratch) / "cache"
        runner, serving = in_process_runner(args.preset, cache_dir)
        request = grpc_request(args.steps)
        resolved = resolve(request, serving)
        server_args = ["--model", args.preset, "--cache-dir", str(cache_dir), "--threads", str(args.threads)]
        server = LocalServer.start(Path(scratch) / "server.log", *server_args, "--http-port", "0")
        try:
            url = re.search(r"SGLang-compatible HTTP API at (\S+)", server.log())[1]
            with RolloutClient(server.address, timeout=600) as client:
                in_process_seconds(runner, resolved, [])  # warm-up: each side encodes the prompt once
                grpc_seconds(client, request)
                http_seconds(url, http_body(args.steps))
                runs = {"a": [], "b": [], "c": []}
                for _ in range(args.repeats):
                    runs["a"].append((in_process_seconds(runner, resolved, []), 0))
                    runs["b"].append(grpc_seconds(client, request))
                    runs["c"].append(http_seconds(url, http_body(args.steps)))
        finally:
            server.stop()
    a = statistics.median(seconds for seconds, _ in runs["a"])
    print(
        f"{args.preset}, {resolved.height}x{resolved.width}, {SAMPLES} samples x {args.steps} steps, "
        f"torch threads {args.threads}, median of {args.repeats} runs\n"
    )
    print("| path | to last byte s | / in-process | bytes on the wire |")
    print("|---|---|---|---|")
    labels = {
        "a": "(a) in process (no images)",
        "b": "(b) gRPC stream",
        "c": "(c) HTTP /rollout/generate (msgpack)",
    }
    for key, label in labels.items():
        seconds = statistics.median(s for s, _ in runs[key])
        size = runs[key][-1][1]
        wire = f"{size / 2**20:.2f} MiB" if size else "-"
        print(f"| {label} | {seconds:.3f} | {seconds / a:.3f} | {wire} |")


if __name__ == "__main__":
    main()
