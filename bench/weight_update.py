"""Weight update throughput: push the whole small-flux transformer and a rank-16 LoRA adapter to a
real server with ``RolloutClient.update_weights``, next to the raw gRPC throughput of a plain bytes
stream (same message size, same byte count, a bare grpc.aio servicer in its own process) and the same
update broadcast over a weight-sync group (``WeightSyncGroup``), measured in the same run,
alternately, so machine noise hits them alike. Then the group's fan-out: the FULL update broadcast to
two replicas against one (a group with both, against a group with the first).

Prints Markdown tables: payload size, median seconds per update as the trainer sees it (encoding or
bucketing, transfer, the server's checks and the apply), the server's own seconds (first message or
manifest to applied), GB/s, and the group against UpdateWeights; the fan-out; then the cost of the
server's finiteness check and of the weights checksum on the FULL payload alone, in this process
with the server's thread count.

    python bench/weight_update.py                 # small-flux, 5 repeats, gloo
    python bench/weight_update.py --repeats 10
    python bench/weight_update.py --device cuda --backend nccl   # a GPU run: the servers on CUDA
"""

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from diffusers import FluxTransformer2DModel
from peft import LoraConfig, get_peft_model_state_dict

from rollout_client import RolloutClient, WeightSyncGroup
from rollout_client.client import UPDATE_CHUNK_BYTES
from rollout_core import checksum, codec
from rollout_core.local_server import LocalServer
from rollout_server.presets import resolve_model
from rollout_server.weights.spec import check_finite

SINK_METHOD = "/bench.Sink/Push"
# FlowGRPO's LoRA targets: every attention projection of the transformer blocks.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def run_sink(ports: multiprocessing.Queue) -> None:
    """A client-streaming servicer that only counts the bytes it receives (no protobuf)."""

    async def push(pieces, context) -> bytes:
        received = 0
        async for piece in pieces:
            received += len(piece)
        return str(received).encode()

    async def serve() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    asyncio.run(serve())


def raw_seconds(push, buffer: bytes) -> float:
    begin = time.perf_counter()
    received = push(codec.pieces(buffer, UPDATE_CHUNK_BYTES), timeout=600)
    assert int(received) == len(buffer)
    return time.perf_counter() - begin


def payloads(model: str, cache_dir: Path | None) -> list[tuple[str, dict, dict]]:
    """(label, tensors, update_weights keyword arguments) per measured update."""
    transformer = FluxTransformer2DModel.from_pretrained(resolve_model(model, cache_dir) / "transformer")
    full = {name: tensor.detach() for name, tensor in transformer.state_dict().items()}
    config = LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    transformer.add_adapter(config)
    adapter = {name: tensor.detach() for name, tensor in get_peft_model_state_dict(transformer).items()}
    return [
        (f"{model} transformer, FULL", full, {}),
        (f"{model} LoRA r=16 ({len(adapter)} tensors)", adapter, {"lora_config": config}),
    ]


def measure(client: RolloutClient, group: WeightSyncGroup, push, payload: tuple, repeats: int) -> dict:
    """UpdateWeights, the group's broadcast and the raw gRPC stream of one payload, alternately. The
    group checks the servers' checksum against one computed here once (a trainer computes its own
    after each step; ``weights checksum`` below times that)."""
    label, tensors, options = payload
    _, buffer = codec.encode(tensors)
    full = not options
    expected = checksum.weights_checksum(checksum.policy_tensors({"transformer": tensors})) if full else None
    runs: dict[str, list[float]] = {"update": [], "server": [], "group": [], "group_server": [], "raw": []}
    for _ in range(repeats + 1):  # the first round warms the channels and the group up
        version = client.server_info().policy_version + 1
        begin = time.perf_counter()
        response = client.update_weights(tensors, version, progress=False, **options)
        runs["update"].append(time.perf_counter() - begin)
        runs["server"].append(response.seconds)
        begin = time.perf_counter()
        [applied] = group.update_weights(tensors, version + 1, expect_checksum=expected, **options)
        runs["group"].append(time.perf_counter() - begin)
        runs["group_server"].append(applied.seconds)
        runs["raw"].append(raw_seconds(push, buffer))
    medians = {name: statistics.median(values[1:]) for name, values in runs.items()}
    return {"label": label, "tensors": len(tensors), "bytes": len(buffer), **medians}


def fan_out(clients: list[RolloutClient], tensors: dict, repeats: int, backend: str) -> dict:
    """Median seconds of the FULL update broadcast to the first replica alone, and to both: a fresh
    group each time, alternately (its set-up is not timed)."""
    runs: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats + 1):
        for count in (1, 2):
            with WeightSyncGroup(clients[:count], backend=backend, timeout=300) as group:
                version = max(client.server_info().policy_version for client in clients[:count]) + 1
                begin = time.perf_counter()
                group.update_weights(tensors, version)
                runs[count].append(time.perf_counter() - begin)
    return {count: statistics.median(values[1:]) for count, values in runs.items()}


def median_seconds(work, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        begin = time.perf_counter()
        work()
        runs.append(time.perf_counter() - begin)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-flux", help="a Flux preset")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="server torch threads")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--device", default="cpu", help="the servers' device")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="the group's backend")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ports: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    sink = multiprocessing.get_context("spawn").Process(target=run_sink, args=(ports,), daemon=True)
    sink.start()
    cache = ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    serve = ["--model", args.model, "--threads", str(args.threads), "--device", args.device, *cache]
    with tempfile.TemporaryDirectory() as scratch:
        servers = [LocalServer.start(Path(scratch) / f"server-{k}.log", *serve) for k in range(2)]
        try:
            clients = [RolloutClient(server.address, timeout=600) for server in servers]
            with grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=60)}") as sink_channel:
                push = sink_channel.stream_unary(SINK_METHOD)
                updates = payloads(args.model, args.cache_dir)
                with WeightSyncGroup(clients[:1], backend=args.backend, timeout=300) as group:
                    rows = [measure(clients[0], group, push, payload, args.repeats) for payload in updates]
                fanned = fan_out(clients, updates[0][1], args.repeats, args.backend)
        finally:
            for server in servers:
                server.stop()
            sink.terminate()
    print(
        f"median of {args.repeats} runs, {UPDATE_CHUNK_BYTES / 2**20:g} MiB messages, "
        f"server torch threads: {args.threads}, loopback\n"
    )
    print(
        "| payload | MiB | UpdateWeights s | GB/s | server s | group s | GB/s | server s "
        "| group vs UpdateWeights | raw gRPC GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gbps = {name: r["bytes"] / r[name] / 1e9 for name in ("update", "group", "raw")}
        print(
            f"| {r['label']} | {r['bytes'] / 2**20:.1f} | {r['update']:.3f} | {gbps['update']:.2f} "
            f"| {r['server']:.3f} | {r['group']:.3f} | {gbps['group']:.2f} | {r['group_server']:.3f} "
            f"| {r['update'] / r['group']:.2f}x | {gbps['raw']:.2f} |"
        )
    label, full, _ = updates[0]
    print(f"\nFan-out of the {label} update over one group ({args.backend}):\n")
    print("| replicas | seconds | vs one replica |")
    print("|---|---|---|")
    for count, seconds in fanned.items():
        print(f"| {count} | {seconds:.3f} | {seconds / fanned[1]:.2f}x |")
    check = median_seconds(lambda: [check_finite(name, t) for name, t in full.items()], args.repeats)
    digest = median_seconds(lambda: checksum.weights_checksum(full), args.repeats)
    print(f"\nfiniteness check of the {label} payload: {check * 1000:.1f} ms")
    print(f"weights checksum of the {label} payload: {digest * 1000:.1f} ms")


if __name__ == "__main__":
    main()
