"""Streaming overhead: the same rollout (a) in-process through the runner and sampler, nothing
encoded, and (b) through a real server, streaming every latent and the env to a client that decodes
every tensor. Both sides cache prompt encodings, as the server does by default.

Prints a Markdown table with the median seconds of each, the ratio b/a and the streamed tensor
throughput. Runs (a) and (b) alternately so machine noise hits both alike.

    python bench/stream_overhead.py                      # all cases
    python bench/stream_overhead.py --cases small-flux   # one case
"""

import argparse
import io
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout.v1 import rollout_pb2
from rollout_client import Finished, RolloutClient
from rollout_core.local_server import LocalServer
from rollout_server import families
from rollout_server.limits import Limits
from rollout_server.metrics import ServerMetrics
from rollout_server.parallel import SequenceParallel
from rollout_server.presets import defaults_for, resolve_model
from rollout_server.prompt_cache import DEFAULT_PROMPT_CACHE_ENTRIES
from rollout_server.runner import Runner
from rollout_server.sampler import advance
from rollout_server.validation import ServingContext, read_images, resolve

if TYPE_CHECKING:
    from rollout_server.images import ConditionImage


def in_process_runner(preset: str, cache_dir: Path) -> tuple[Runner, ServingContext]:
    """The model loaded on this thread, where (a) runs it (as the server's worker does for (b))."""
    adapter = families.load(resolve_model(preset, cache_dir), torch.device("cpu"), torch.float32)
    # The server's prompt cache as well: both sides encode the prompts once, in the warm-up.
    runner = Runner(
        adapter,
        SequenceParallel(),
        Limits(),
        DEFAULT_PROMPT_CACHE_ENTRIES,
        ServerMetrics(),
    )
    defaults = defaults_for(preset, adapter.defaults())
    return runner, ServingContext.of(adapter, defaults, Limits())


def in_process_seconds(
    runner: Runner, request: rollout_pb2.RolloutRequest, condition_images: list["ConditionImage"]
) -> float:
    """(a): prompt encoding and the sampler loop, no events, no serialisation."""
    begin = time.perf_counter()
    rollout = runner.prepare(0, request, condition_images)
    while not rollout.done:
        velocities = runner.velocities([rollout], dropped=lambda key: False)
        advance(rollout.plan, rollout.state, velocities.guided[rollout.key])
    return time.perf_counter() - begin


def streamed_seconds(client: RolloutClient, request: rollout_pb2.RolloutRequest) -> tuple[float, int]:
    """(b): the same rollout through the server; every tensor is decoded by the client."""
    begin = time.perf_counter()
    tensor_bytes = 0
    for event in client.stream(request):  # decode_stream turns every payload into torch tensors
        if isinstance(event, Finished):
            tensor_bytes = event.message.tensor_bytes
    return time.perf_counter() - begin, tensor_bytes


# (label, preset, request fields beyond the common ones). The last case is payload-heavy: every
# latent plus the eps, mean and velocity debug tensors of 8 samples at 1024x1024.
CASES = [
    ("tiny-flux", "tiny-flux", {}),
    ("tiny-sd3", "tiny-sd3", {}),
    ("tiny-qwen-image", "tiny-qwen-image", {}),
    ("small-flux", "small-flux", {}),
    ("tiny-wan, 9 frames", "tiny-wan", {"num_frames": 9}),
    ("tiny-flux-kontext (edit)", "tiny-flux-kontext", {}),
    ("tiny-qwen-image-edit (edit)", "tiny-qwen-image-edit", {}),
    ("tiny-wan-i2v, 9 frames", "tiny-wan-i2v", {"num_frames": 9}),
    (
        "tiny-flux, 1024px + debug tensors",
        "tiny-flux",
        {
            "height": 1024,
            "width": 1024,
            "samples_per_prompt": 4,
            "debug_tensors": [
                rollout_pb2.DEBUG_TENSOR_EPS,
                rollout_pb2.DEBUG_TENSOR_MEAN,
                rollout_pb2.DEBUG_TENSOR_VELOCITY,
            ],
        },
    ),
]


def gradient_png(index: int, side: int = 128) -> bytes:
    """A conditioning image: a colour gradient, different per ``index``."""
    ramp = np.linspace(0, 255, side, dtype=np.uint8)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], np.uint8(60 * index)), axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format="PNG")
    return buffer.getvalue()


def measure(label: str, preset: str, fields: dict, args, cache_dir: Path, log_dir: Path) -> dict:
    torch.set_num_threads(args.threads)
    request = rollout_pb2.RolloutRequest(
        prompts=["a watercolour fox in a misty forest", "a lighthouse on a cliff at dusk"],
        samples_per_prompt=2,
        base_seed=1,
        num_steps=args.steps,
        latents=rollout_pb2.LATENT_SELECTION_ALL,
        images=False,
    )
    request.MergeFrom(rollout_pb2.RolloutRequest(**fields))
    runner, serving = in_process_runner(preset, cache_dir)
    if runner.adapter.takes_images:  # editing and image-to-video: an input image per prompt
        request.condition_images.extend(rollout_pb2.ConditionImage(data=gradient_png(p)) for p in range(2))
    request = resolve(request, serving)
    condition_images = read_images(request, serving)  # as admission decodes them, once
    server_args = ["--model", preset, "--cache-dir", str(cache_dir), "--threads", str(args.threads)]
    server = LocalServer.start(log_dir / f"{preset}.log", *server_args)
    try:
        with RolloutClient(server.address, timeout=600) as client:
            in_process_seconds(runner, request, condition_images)  # warm-up both sides
            streamed_seconds(client, request)
            a_runs, b_runs = [], []
            for _ in range(args.repeats):
                a_runs.append(in_process_seconds(runner, request, condition_images))
                seconds, tensor_bytes = streamed_seconds(client, request)
                b_runs.append(seconds)
    finally:
        server.stop()
    a, b = statistics.median(a_runs), statistics.median(b_runs)
    return {
        "case": label,
        "shape": f"{request.height}x{request.width} | {len(request.seeds)} x {request.num_steps}",
        "step_ms": 1000 * a / request.num_steps,
        "a": a,
        "b": b,
        "ratio": b / a,
        "mib": tensor_bytes / 2**20,
        "gbps": tensor_bytes / b / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", default=[label for label, _, _ in CASES], help="case labels")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        cache_dir = args.cache_dir or Path(scratch) / "cache"
        rows = [
            measure(label, preset, fields, args, cache_dir, Path(scratch))
            for label, preset, fields in CASES
            if label in args.cases
        ]
    print(f"torch threads: {args.threads}, median of {args.repeats} runs, latents ALL + env, images off\n")
    print(
        "| case | size | samples x steps | ms/step (a) | (a) in-process s | (b) streamed s | b/a "
        "| streamed MiB | streamed GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['shape']} | {r['step_ms']:.1f} | {r['a']:.3f} | {r['b']:.3f} "
            f"| {r['ratio']:.3f} | {r['mib']:.1f} | {r['gbps']:.3f} |"
        )


if __name__ == "__main__":
    main()
