"""Weight update throughput: push the whole small-flux transformer and a rank-16 LoRA adapter to a
real server with ``RolloutClient.update_weights``, next to the raw gRPC throughput of a plain bytes
stream (same message size, same byte count, a bare grpc.aio servicer in its own process) measured in
the same run, alternately, so machine noise hits both alike.

Prints a Markdown table: payload size, median seconds per update as the trainer sees it (safetensors
encoding, transfer, the server's checks and the apply), the server's own seconds (first message to
applied), and GB/s of both; then the cost of the server's finiteness check on the FULL payload alone,
in this process with the server's thread count.

    python bench/weight_update.py                 # small-flux, 5 repeats
    python bench/weight_update.py --repeats 10
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

from rollout_client import RolloutClient
from rollout_client.client import UPDATE_CHUNK_BYTES
from rollout_core import codec
from rollout_server.local import LocalServer
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


def measure(client: RolloutClient, push, label: str, tensors: dict, options: dict, repeats: int) -> dict:
    _, buffer = codec.encode(tensors)
    update_runs, server_runs, raw_runs = [], [], []
    for _ in range(repeats + 1):  # the first round warms both channels up
        version = client.server_info().policy_version + 1
        begin = time.perf_counter()
        response = client.update_weights(tensors, version, progress=False, **options)
        update_runs.append(time.perf_counter() - begin)
        server_runs.append(response.seconds)
        raw_runs.append(raw_seconds(push, buffer))
    update, server, raw = (statistics.median(runs[1:]) for runs in (update_runs, server_runs, raw_runs))
    size = len(buffer)
    return {
        "label": label,
        "tensors": len(tensors),
        "mib": size / 2**20,
        "update": update,
        "gbps": size / update / 1e9,
        "server": server,
        "server_gbps": size / server / 1e9,
        "raw": raw,
        "raw_gbps": size / raw / 1e9,
    }


def finiteness_check_seconds(tensors: dict, repeats: int) -> float:
    """Median seconds of the server's finiteness check over every tensor of ``tensors``."""
    runs = []
    for _ in range(repeats):
        begin = time.perf_counter()
        for name, tensor in tensors.items():
            check_finite(name, tensor)
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ports: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    sink = multiprocessing.get_context("spawn").Process(target=run_sink, args=(ports,), daemon=True)
    sink.start()
    cache = ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    with tempfile.TemporaryDirectory() as scratch:
        server = LocalServer.start(
            Path(scratch) / "server.log", "--model", args.model, "--threads", str(args.threads), *cache
        )
        try:
            with (
                RolloutClient(server.address, timeout=600) as client,
                grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=60)}") as sink_channel,
            ):
                push = sink_channel.stream_unary(SINK_METHOD)
                updates = payloads(args.model, args.cache_dir)
                rows = [
                    measure(client, push, label, tensors, options, args.repeats)
                    for label, tensors, options in updates
                ]
        finally:
            server.stop()
            sink.terminate()
    print(
        f"median of {args.repeats} runs, {UPDATE_CHUNK_BYTES / 2**20:g} MiB messages, "
        f"server torch threads: {args.threads}, loopback\n"
    )
    print("| payload | MiB | update s | update GB/s | server s | server GB/s | raw gRPC s | raw gRPC GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['mib']:.1f} | {r['update']:.3f} | {r['gbps']:.2f} | {r['server']:.3f} "
            f"| {r['server_gbps']:.2f} | {r['raw']:.3f} | {r['raw_gbps']:.2f} |"
        )
    label, full, _ = updates[0]
    seconds = finiteness_check_seconds(full, args.repeats)
    print(f"\nfiniteness check of the {label} payload: {seconds * 1000:.1f} ms")


if __name__ == "__main__":
    main()
