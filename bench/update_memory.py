"""Host memory of a FULL weight update: how far each rank's resident memory rises above its level
before the update, in units of the update's size, on servers at SP=1 and SP=2; pushed by gRPC
UpdateWeights, or with ``--via`` as an HTTP ``/update_weights_from_tensor`` body (safetensors bytes in
base64 JSON, or in msgpack).

Each rank's peak resident set is reset just before the update (``/proc/<pid>/clear_refs``, Linux) and
read back from ``VmHWM`` once the update has been applied, so the figure is the true peak of the
update, not a sample of it. A figure of 1.0 means the update held one extra copy of the weights.

    python bench/update_memory.py                  # small-flux, SP=1 and SP=2
    python bench/update_memory.py --sp 2
    python bench/update_memory.py --sp 1 --via grpc http-json http-msgpack
"""

import argparse
import base64
import json
import os
import re
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import msgpack
from diffusers import FluxTransformer2DModel
from safetensors.torch import save

from rollout_client import RolloutClient
from rollout_core import codec
from rollout_core.local_server import LocalServer
from rollout_server.presets import resolve_model

RANK_READY = re.compile(r"rank (?P<rank>\d+) of \d+ ready \(pid (?P<pid>\d+)")
HTTP_LINE = re.compile(r"SGLang-compatible HTTP API at (?P<url>\S+) ")


def resident_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of a process, in KiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)[1])


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak resident set size


def push(via: str, server: LocalServer, client: RolloutClient, tensors: dict) -> None:
    """The FULL update ``tensors``, by gRPC or as an HTTP body (encoded before the peak is reset)."""
    if via == "grpc":
        client.update_weights(tensors, client.server_info().policy_version + 1, progress=False)
        return
    data = save({name: tensor.contiguous() for name, tensor in tensors.items()})
    url = f"{HTTP_LINE.search(server.log())['url']}/update_weights_from_tensor"
    if via == "http-json":
        body = {"serialized_named_tensors": [base64.b64encode(data).decode()], "weight_update_mode": "full"}
        content, content_type = json.dumps(body).encode(), "application/json"
    else:
        body = {"serialized_named_tensors": [data], "weight_update_mode": "full"}
        content, content_type = msgpack.packb(body), "application/msgpack"
    httpx.post(url, content=content, headers={"content-type": content_type}, timeout=600).raise_for_status()


def measure(model: str, sp: int, threads: int, cache_dir: Path | None, via: str) -> list[dict]:
    """One row per rank: resident MiB before, peak MiB during, and the rise over the update's size."""
    transformer = FluxTransformer2DModel.from_pretrained(resolve_model(model, cache_dir) / "transformer")
    cache = ["--cache-dir", str(cache_dir)] if cache_dir else []
    http = [] if via == "grpc" else ["--http-port", "0"]
    tensors = {name: tensor.detach() for name, tensor in transformer.state_dict().items()}
    update_bytes = len(codec.encode(tensors)[1])
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "server.log"
        server = LocalServer.start(
            log, "--model", model, "--sp", str(sp), "--threads", str(threads), *cache, *http
        )
        try:
            pids = {0: server.process.pid}
            pids.update({int(m["rank"]): int(m["pid"]) for m in RANK_READY.finditer(server.log())})
            with RolloutClient(server.address, timeout=600) as client:
                before = {rank: resident_kib(pid, "VmRSS") for rank, pid in pids.items()}
                for pid in pids.values():
                    reset_peak(pid)
                push(via, server, client, tensors)
                peak = {rank: resident_kib(pid, "VmHWM") for rank, pid in pids.items()}
        finally:
            server.stop()
    return [
        {
            "via": via,
            "sp": sp,
            "rank": rank,
            "before": before[rank] / 1024,
            "peak": peak[rank] / 1024,
            "copies": (peak[rank] - before[rank]) * 1024 / update_bytes,
            "update_mib": update_bytes / 2**20,
        }
        for rank in sorted(pids)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-flux", help="a Flux preset")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="SP degrees to measure")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument(
        "--via", nargs="+", default=["grpc"], choices=["grpc", "http-json", "http-msgpack"], help="transports"
    )
    args = parser.parse_args()
    rows = [
        row
        for via in args.via
        for sp in args.sp
        for row in measure(args.model, sp, args.threads, args.cache_dir, via)
    ]
    print(
        f"FULL update of the {args.model} transformer ({rows[0]['update_mib']:.0f} MiB), "
        "host memory per rank\n"
    )
    print("| via | SP | rank | resident before, MiB | peak during the update, MiB | rise / update size |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        memory = f"{r['before']:.0f} | {r['peak']:.0f} | {r['copies']:.2f}"
        print(f"| {r['via']} | {r['sp']} | {r['rank']} | {memory} |")


if __name__ == "__main__":
    main()
