"""The memory estimate against measured peaks: for each family's tiny preset at three sizes, the
server's estimate of one request (``memory.estimate`` and ``MemoryBudget.peak``, as admission computes
it) beside the peak resident memory that a fresh server took above its idle size to run it.

Each measurement starts its own server, forked from a process that imported the server's modules once
(``tests/forked.py``, as the tests start theirs), runs one small request to page in the code (a video
family's of two latent frames), resets the peak resident set (``/proc/<pid>/clear_refs``, Linux) and
runs the request: the figure is ``VmHWM`` once it has ended less ``VmRSS`` before it. Requests have
images on (each decode piece included, unless ``--no-images``), 2 steps and the family's default CFG.

    python bench/memory_estimate.py                                     # every family, three sizes
    python bench/memory_estimate.py --families hunyuan-video15 cosmos3
    python bench/memory_estimate.py --families hunyuan-video15 --no-images --sizes 1x1024x1024x1
"""

import argparse
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' fork server
from forked import ForkedProcess

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_core.local_server import LocalServer
from rollout_server import families, memory
from rollout_server.limits import Limits
from rollout_server.presets import default_cache_dir, defaults_for, resolve_model
from rollout_server.scheduler import STREAM_BUFFER
from rollout_server.validation import ServingContext, resolve

# One preset per family (Wan 2.2's is Wan's family with a second expert).
PRESETS = {
    "flux": "tiny-flux",
    "flux-kontext": "tiny-flux-kontext",
    "flux2": "tiny-flux2",
    "flux2-klein": "tiny-flux2-klein",
    "sd3": "tiny-sd3",
    "qwen-image": "tiny-qwen-image",
    "qwen-image-edit": "tiny-qwen-image-edit",
    "z-image": "tiny-z-image",
    "wan": "tiny-wan",
    "wan-i2v": "tiny-wan-i2v",
    "hunyuan-video15": "tiny-hunyuan-video15",
    "ltx2": "tiny-ltx2",
    "cosmos3": "tiny-cosmos3",
}
# (samples, side, latent frames) of the three requests of an image family, and of a video family's.
IMAGE_SIZES = ((2, 256, 1), (2, 512, 1), (1, 1024, 1))
VIDEO_SIZES = ((2, 128, 3), (1, 256, 3), (1, 512, 2))


@dataclass(frozen=True)
class Row:
    family: str
    request: str
    estimate: int
    measured: int

    def markdown(self) -> str:
        estimate, measured = self.estimate / 2**20, self.measured / 2**20
        ratio = measured / estimate
        return f"| {self.family} | {self.request} | {estimate:.0f} | {measured:.0f} | {ratio:.2f} |"


def resident_bytes(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of a process, in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)[1]) * 1024


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak resident set size


def png(width: int, height: int) -> bytes:
    """A conditioning image at the request's size: a gradient."""
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def default_sizes(adapter) -> list[tuple[int, int, int, int]]:
    """(samples, height, width, frames) of the family's three requests."""
    if adapter.max_frames == 1:
        return [(samples, side, side, 1) for samples, side, _ in IMAGE_SIZES]
    return [(samples, side, side, 1 + adapter.frame_step * (n - 1)) for samples, side, n in VIDEO_SIZES]


def request_of(adapter, samples: int, height: int, width: int, frames: int, images: bool):
    request = rollout_pb2.RolloutRequest(
        prompts=["a red fox in the snow"],
        samples_per_prompt=samples,
        height=height,
        width=width,
        num_frames=frames,
        num_steps=2,
        base_seed=7,
        images=images,
    )
    if adapter.takes_images:
        request.condition_images.add(data=png(width, height))
    return request


def described(request: rollout_pb2.RolloutRequest) -> str:
    size = f"{request.height} x {request.width}" + (
        f" x {request.num_frames} frames" if request.num_frames > 1 else ""
    )
    return f"{request.samples_per_prompt} x {size}"


def measure(family: str, sizes, images: bool, cache_dir: Path, threads: int, scratch: Path) -> list[Row]:
    """The family's requests at ``sizes`` (its three by default), each on a fresh server: the estimate
    and the measured peak."""
    preset = PRESETS[family]
    adapter = families.load(resolve_model(preset, cache_dir), torch.device("cpu"), torch.float32)
    limits = Limits()
    serving = ServingContext.of(adapter, defaults_for(preset, adapter.defaults()), limits)
    profile = adapter.measure_vae()
    budget = memory.MemoryBudget(0, limits)
    side, frames = 2 * adapter.min_side, 1 + adapter.frame_step  # a video's fewest frames past one
    warm_up = request_of(adapter, 1, side, side, frames, images)
    warm_up.num_steps = adapter.min_steps
    rows = []
    for k, size in enumerate(sizes or default_sizes(adapter)):
        request = request_of(adapter, *size, images)
        backlog = STREAM_BUFFER * limits.max_message_bytes
        estimate = memory.estimate(adapter, profile, resolve(request, serving), backlog)
        log = scratch / f"{family}-{k}.log"
        argv = ["serve", "--port", "0", "--cache-dir", str(cache_dir), "--threads", str(threads)]
        server = LocalServer.once_serving(ForkedProcess([*argv, "--model", preset], log), log, 300)
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                list(stub.Rollout(warm_up, timeout=600))
                before = resident_bytes(server.process.pid, "VmRSS")
                reset_peak(server.process.pid)
                messages = list(stub.Rollout(request, timeout=1800))
                peak = resident_bytes(server.process.pid, "VmHWM")
            if not messages[-1].HasField("finished"):
                raise RuntimeError(f"{family} {described(request)} did not finish")
        finally:
            server.stop()
        rows.append(Row(family, described(request), budget.peak([estimate]), peak - before))
    return rows


def parse_size(text: str) -> tuple[int, int, int, int]:
    """``SAMPLESxHEIGHTxWIDTHxFRAMES``, e.g. 1x1024x2048x1."""
    samples, height, width, frames = map(int, text.split("x"))
    return samples, height, width, frames


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", choices=sorted(PRESETS), default=list(PRESETS))
    parser.add_argument("--sizes", nargs="+", type=parse_size, help="SAMPLESxHEIGHTxWIDTHxFRAMES each")
    parser.add_argument("--no-images", action="store_true", help="requests without images (no decode)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the preset cache")
    args = parser.parse_args()
    cache_dir = args.cache_dir or default_cache_dir()
    images = "no images" if args.no_images else "images"
    print(
        f"| family | request ({images}, 2 steps) | estimate, MiB | measured peak, MiB | measured / estimate |"
    )
    print("|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            try:
                rows = measure(family, args.sizes, not args.no_images, cache_dir, args.threads, Path(scratch))
            except ImportError as error:  # a preset whose builder needs what is not installed
                print(f"{family}: skipped ({error})", file=sys.stderr)
                continue
            for row in rows:
                print(row.markdown(), flush=True)


if __name__ == "__main__":
    main()
