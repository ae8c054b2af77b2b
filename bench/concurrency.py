"""Concurrency: rollouts/s, latency and time to first step when C clients share one server. Two
servers per case: "batched" (the server's defaults: rows of concurrent requests share transformer
forwards) and "serial" (--max-batch-size 1: batching off, one row per forward).

Every request is 1 prompt x 2 samples, manifest-only with images off (the engine is measured, not PNG
encoding or tensor serialisation), with a prompt and seeds of its own: no prompt repeats, so every
rollout encodes its prompt, and the two servers get the same requests. For each C, rounds run on one
server and then the other, the first server flipping every round and every C; in a round all C
clients start together and each runs its requests back to back. Per request: latency (submit ->
Finished) and TTFS, time to first step (submit -> first Step event); per round: rollouts / wall
seconds. Printed per C: the median rollouts/s of the rounds, the median of the per-round ratios
batched / serial, and p50/p95 latency and p50 TTFS over every request of the rounds. Each server
first gets a warm-up round (4 clients, 2 steps), not counted.

Mid-rollout arrival: while one long rollout (1 prompt x 2 samples, --arrival-steps) runs, a new
request arrives once the long one has streamed a quarter of its steps. Printed: the newcomer's TTFS,
the long rollout's median step time (between its Step events), the newcomer's prompt encoding seconds
(encode_seconds of its Finished event) and TTFS / (2 * step + encode): a server that admits newcomers
at the next step boundary keeps this at or below 1; one that runs rollouts to completion makes the
newcomer wait for the rest of the long one.

Defaults on CPU are sized for a 2-core machine (about 9 minutes): tiny-flux gets 3 rounds of 2
requests per client, small-flux (about 5 s a rollout, 100 s a C=16 round per server) 1 round of 1
request. On an accelerator every case gets 3 rounds of 2.

Fairness:
- --threads 1 (torch threads per server). The servers alternate, so one is busy at a time; one core
  runs the model and the other the harness (client threads, both gRPC sides, stream encoding), whose
  load differs between the servers (a batched server streams the steps of several requests at once)
  and would otherwise land on the model's cores. With 2 threads, any other busy thread stalls torch:
  on this 2-core machine, with another process running, a small-flux forward took 1.5-3 s with 2
  threads and 0.25 s with 1.
- Each client thread has its own RolloutClient (channel), as independent trainers do. gRPC carries
  channels to one address over one TCP connection either way; one client shared by all threads
  (--channels shared) measured the same within noise.
- Both servers get --max-queued above the largest C (admission, not batching): no client is refused.

    python bench/concurrency.py                                   # tiny-flux 128px, small-flux 256px
    python bench/concurrency.py --cases tiny-flux --clients 1,16 --rounds 5
    python bench/concurrency.py --device cuda --dtype bfloat16 --size 512
"""

import argparse
import contextlib
import itertools
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout.v1 import rollout_pb2
from rollout_client import Finished, RolloutClient, Step
from rollout_core.local_server import LocalServer

# preset -> default image side, and on CPU (rounds, requests per client): see the docstring.
SIZES = {"tiny-flux": 128, "small-flux": 256}
CPU_ROUNDS = {"tiny-flux": (3, 2), "small-flux": (1, 1)}
SERVERS = {"batched": (), "serial": ("--max-batch-size", "1")}
SUBJECTS = ["a red fox", "a lighthouse", "two cats", "a bowl of ramen", "an old tram", "a paper kite"]
PLACES = ["in the snow", "at dusk", "on a sofa", "under neon rain", "in a misty forest", "by the sea"]
# 4 requests of 2 samples fill a forward of the default --max-batch-size (8 rows).
WARM_UP_CLIENTS = 4
WARM_UP_STEPS = 2  # the same shapes as the measured rollouts, in fewer steps
CALL_TIMEOUT = 900.0  # seconds: each rollout's gRPC deadline, and the bound on waiting for a round


def prompt(n: int) -> str:
    """The n-th of an endless series of distinct prompts (one per request: no prompt cache hits)."""
    return f"{SUBJECTS[n % 6]} {PLACES[n // 6 % 6]}, study {n}"


@dataclass
class Timed:
    """One rollout as its client saw it (perf_counter seconds)."""

    submitted: float
    steps: list[float] = field(default_factory=list)  # arrival of each Step event
    done: float = 0.0  # arrival of the Finished event
    finished: rollout_pb2.RolloutFinished | None = None

    @property
    def latency(self) -> float:
        return self.done - self.submitted

    @property
    def ttfs(self) -> float:
        return self.steps[0] - self.submitted


def run(client: RolloutClient, request: rollout_pb2.RolloutRequest, on_step=None) -> Timed:
    timed = Timed(time.perf_counter())
    for event in client.stream(request):
        now = time.perf_counter()
        if isinstance(event, Step):
            timed.steps.append(now)
            if on_step is not None:
                on_step(event.index)
        elif isinstance(event, Finished):
            timed.done, timed.finished = now, event.message
    if timed.finished is None or len(timed.steps) != request.num_steps:
        ended = "a Finished event" if timed.finished else "no Finished event"
        raise RuntimeError(f"{request.request_id}: {len(timed.steps)}/{request.num_steps} steps, {ended}")
    return timed


def request(n: int, args, steps: int | None = None) -> rollout_pb2.RolloutRequest:
    return rollout_pb2.RolloutRequest(
        request_id=f"bench-{n}",
        prompts=[prompt(n)],
        samples_per_prompt=2,
        base_seed=1000 + 2 * n,
        height=args.size,
        width=args.size,
        num_steps=steps or args.steps,
        manifest_only=True,
        images=False,
    )


def round_(
    address: str, clients: int, per_client: int, first: int, args, steps: int | None = None
) -> tuple[float, list[Timed]]:
    """All clients start together; returns (rollouts/s, every request's timing). Requests are numbered
    from ``first`` (client-major), so the same numbers give both servers the same prompts and seeds."""
    start = threading.Barrier(clients, timeout=CALL_TIMEOUT)
    shared = RolloutClient(address, timeout=CALL_TIMEOUT) if args.channels == "shared" else None

    def client_thread(c: int) -> list[Timed]:
        client = shared or RolloutClient(address, timeout=CALL_TIMEOUT)
        try:
            client.server_info()  # connected before the clock starts
            start.wait()
            numbers = range(first + c * per_client, first + (c + 1) * per_client)
            return [run(client, request(n, args, steps)) for n in numbers]
        except BaseException:
            start.abort()  # the others stop waiting for this one
            raise
        finally:
            if client is not shared:
                client.close()

    try:
        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(client_thread, c) for c in range(clients)]
            errors = [future.exception(timeout=CALL_TIMEOUT * (per_client + 1)) for future in futures]
    finally:
        if shared is not None:
            shared.close()
    errors = sorted(filter(None, errors), key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if errors:
        raise errors[0]  # the cause, rather than a thread that only saw the barrier break
    timings = [t for future in futures for t in future.result()]
    wall = max(t.done for t in timings) - min(t.submitted for t in timings)
    return len(timings) / wall, timings


def arrival(address: str, first: int, args) -> dict:
    """The long rollout and a newcomer that arrives once it has streamed a quarter of its steps."""
    quarter = threading.Event()
    trigger = max(args.arrival_steps // 4, 1) - 1
    with RolloutClient(address, timeout=CALL_TIMEOUT) as a, RolloutClient(address, timeout=CALL_TIMEOUT) as b:
        b.server_info()
        with ThreadPoolExecutor(1) as pool:
            on_step = lambda index: index == trigger and quarter.set()  # noqa: E731
            running = pool.submit(run, a, request(first, args, args.arrival_steps), on_step)
            while not quarter.wait(0.01):
                if running.done():
                    running.result()  # its error
                    raise RuntimeError(f"the long rollout ended before step {trigger}")
            newcomer = run(b, request(first + 1, args))
            long = running.result(timeout=CALL_TIMEOUT)
    step = statistics.median(later - earlier for earlier, later in itertools.pairwise(long.steps))
    encode = newcomer.finished.encode_seconds
    ratio = newcomer.ttfs / (2 * step + encode)
    return {"ttfs": newcomer.ttfs, "step": step, "encode": encode, "ratio": ratio}


def forward_bound(preset: str, args) -> dict[int, float]:
    """The model's own bound on batching: ms per row of one transformer forward at 1 row and at the
    server's default --max-batch-size, in-process with the servers' torch threads (nothing else
    running). Batching cannot make the forwards faster than their ratio."""
    import torch

    from rollout_core import dtypes
    from rollout_core.transformer_call import call_transformer, stack_envs
    from rollout_server import families
    from rollout_server.families.base import MediaShape
    from rollout_server.limits import Limits
    from rollout_server.presets import resolve_model

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), dtypes.BY_NAME[args.dtype]
    adapter = families.load(resolve_model(preset, args.cache_dir), device, dtype)
    shape = MediaShape(frames=1, height=args.size, width=args.size)
    env = adapter.encode_text("a red fox in the snow", 3.5, shape)
    per_row = {}
    with torch.inference_mode():
        for rows in (1, Limits.max_batch_size):
            x = torch.randn(rows, *adapter.latent_shape(shape), device=device)
            batch_env = stack_envs([env] * rows, adapter.batched_env_keys)
            timesteps = torch.full((rows,), 500.0)
            seconds = []
            for _ in range(7):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                began = time.perf_counter()
                call_transformer(
                    adapter.transformer,
                    x,
                    timesteps,
                    batch_env,
                    dtype,
                    adapter.timestep_divisor,
                    adapter.conditioning,
                )
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - began)
            per_row[rows] = 1000 * statistics.median(seconds[2:]) / rows  # the first two warm up
    return per_row


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def measure(preset: str, args, scratch: Path) -> tuple[list[dict], dict[str, dict]]:
    cache = ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    common = [
        *("--model", preset, "--device", args.device, "--dtype", args.dtype),
        *("--threads", str(args.threads), "--max-queued", str(max(16, 2 * max(args.clients))), *cache),
    ]
    rows, arrivals = [], {}
    with contextlib.ExitStack() as stop:  # every server started is stopped, whatever fails
        addresses = {}
        for label, flags in SERVERS.items():
            server = LocalServer.start(scratch / f"{preset}-{label}.log", *common, *flags)
            stop.callback(server.stop)
            addresses[label] = server.address
        # Request numbers (a prompt and seeds each) never repeat: warm-up 10^8.., rounds C * 10^6 +
        # round * 10^4.., arrivals 2 * 10^8..
        for label in SERVERS:
            round_(addresses[label], WARM_UP_CLIENTS, 1, 10**8, args, WARM_UP_STEPS)
        for i, clients in enumerate(args.clients):
            rates: dict[str, list[float]] = {label: [] for label in SERVERS}
            timings: dict[str, list[Timed]] = {label: [] for label in SERVERS}
            for r in range(args.rounds):
                first = clients * 10**6 + r * 10**4
                # The first server flips every round and every C: drift (and a single round) favours
                # neither.
                for label in list(SERVERS)[:: 1 if (i + r) % 2 == 0 else -1]:
                    rate, timed = round_(addresses[label], clients, args.requests_per_client, first, args)
                    rates[label].append(rate)
                    timings[label].extend(timed)
            row = {"clients": clients}
            for label in SERVERS:
                latencies = [t.latency for t in timings[label]]
                row[label] = {
                    "rate": statistics.median(rates[label]),
                    "p50": percentile(latencies, 0.5),
                    "p95": percentile(latencies, 0.95),
                    "ttfs": percentile([t.ttfs for t in timings[label]], 0.5),
                }
            pairs = zip(rates["batched"], rates["serial"], strict=True)
            row["ratio"] = statistics.median(b / s for b, s in pairs)
            rows.append(row)
        runs: dict[str, list[dict]] = {label: [] for label in SERVERS}
        for r in range(args.rounds):
            for label in list(SERVERS)[:: 1 if r % 2 == 0 else -1]:
                runs[label].append(arrival(addresses[label], 2 * 10**8 + 2 * r, args))
        for label, measured in runs.items():
            arrivals[label] = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
    return rows, arrivals


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="tiny-flux,small-flux", help="comma-separated presets")
    parser.add_argument("--clients", default="1,4,8,16", help="comma-separated concurrent clients")
    parser.add_argument("--size", type=int, default=None, help="image side (default: 128 tiny, 256 small)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (CPU: 1 small-flux)")
    parser.add_argument("--requests-per-client", type=int, default=None, help="default 2 (CPU: 1 small-flux)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--arrival-steps", type=int, default=20, help="steps of the long rollout")
    parser.add_argument("--channels", choices=("per-client", "shared"), default="per-client")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    began = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for preset in args.cases.split(","):
            rounds, per_client = CPU_ROUNDS.get(preset, (1, 1)) if args.device == "cpu" else (3, 2)
            case = argparse.Namespace(**vars(args))
            case.size = args.size or SIZES.get(preset, 256)
            case.rounds = args.rounds or rounds
            case.requests_per_client = args.requests_per_client or per_client
            results.append((case, preset, forward_bound(preset, case), *measure(preset, case, Path(scratch))))
    print(
        f"{args.device} {args.dtype}, {args.threads} torch thread(s) per server, {args.channels} channels; "
        f"every request 1 prompt x 2 samples x {args.steps} steps, manifest-only, no images"
    )
    for case, preset, bound, rows, arrivals in results:
        print(
            f"\n{preset}, {case.size}x{case.size}: {case.rounds} round(s) per C after a warm-up, "
            f"{case.requests_per_client} request(s) per client back to back"
        )
        (one, one_ms), (many, many_ms) = bound.items()
        print(
            f"model bound (in-process forward): {one_ms:.2f} ms/row at {one} row, {many_ms:.2f} ms/row at "
            f"{many} rows: batching speeds the forwards up at most {one_ms / many_ms:.2f}x\n"
        )
        print(
            "| C | batched rollouts/s | serial rollouts/s | ratio | batched p50/p95 latency s "
            "| serial p50/p95 latency s | batched p50 TTFS s | serial p50 TTFS s |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            b, s = r["batched"], r["serial"]
            print(
                f"| {r['clients']} | {b['rate']:.2f} | {s['rate']:.2f} | {r['ratio']:.2f} "
                f"| {b['p50']:.3f} / {b['p95']:.3f} | {s['p50']:.3f} / {s['p95']:.3f} "
                f"| {b['ttfs']:.3f} | {s['ttfs']:.3f} |"
            )
        print(
            f"\nmid-rollout arrival: a new request once a {args.arrival_steps}-step rollout has streamed "
            f"{max(args.arrival_steps // 4, 1)} steps, median of {case.rounds}\n"
        )
        print("| server | TTFS s | step s | encode s | TTFS / (2*step + encode) |")
        print("|---|---|---|---|---|")
        for label, a in arrivals.items():
            print(f"| {label} | {a['ttfs']:.3f} | {a['step']:.4f} | {a['encode']:.4f} | {a['ratio']:.2f} |")
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
