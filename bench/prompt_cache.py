"""Prompt cache: what a repeated prompt group saves. The same request (4 prompts x 4 samples, true
CFG with a negative prompt, 2 steps) goes alternately to a server with the prompt cache (default
size) and to one without it (--prompt-cache-entries 0); after a warm-up round the cached server
encodes nothing. Prints the median encode seconds and rollout seconds of each from the finished
events, and their ratios.

    python bench/prompt_cache.py                    # small-flux and tiny-qwen-image
    python bench/prompt_cache.py --cases small-flux
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout_client import Finished, RolloutClient
from rollout_core.local_server import LocalServer

PROMPTS = ["a red fox in the snow", "a lighthouse at dusk", "two cats on a sofa", "a bowl of ramen"]


def finished(client: RolloutClient, cfg_field: str) -> Finished:
    request = {
        "prompts": PROMPTS,
        "samples_per_prompt": 4,
        "base_seed": 3,
        "num_steps": 2,
        cfg_field: 2.0,
        "negative_prompt": "blurry, low quality",
        "manifest_only": True,
        "images": False,
    }
    return list(client.stream(**request))[-1]


def measure(preset: str, repeats: int, scratch: Path, cache_dir: Path | None) -> dict:
    cache = ["--cache-dir", str(cache_dir)] if cache_dir else []
    servers = {
        label: LocalServer.start(
            scratch / f"{preset}-{label}.log", "--model", preset, "--threads", "2", *cache, *flags
        )
        for label, flags in (("cached", ()), ("uncached", ("--prompt-cache-entries", "0")))
    }
    runs: dict[str, list[Finished]] = {label: [] for label in servers}
    try:
        clients = {label: RolloutClient(server.address, timeout=600) for label, server in servers.items()}
        cfg_field = clients["cached"].server_info().cfg_scale_field
        for _ in range(repeats + 1):  # the first round warms up (and fills the cache)
            for label, client in clients.items():
                runs[label].append(finished(client, cfg_field))
    finally:
        for server in servers.values():
            server.stop()

    def median(label: str, field: str) -> float:
        return statistics.median(getattr(event.message, field) for event in runs[label][1:])

    hits = runs["cached"][-1].message.prompt_cache_hits
    return {
        "preset": preset,
        "hits": f"{hits}/{hits + runs['cached'][-1].message.prompts_encoded}",
        **{
            f"{label}_{field}": median(label, f"{field}_seconds")
            for label in runs
            for field in ("encode", "total")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", default=["small-flux", "tiny-qwen-image"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        rows = [measure(preset, args.repeats, Path(scratch), args.cache_dir) for preset in args.cases]
    print(f"median of {args.repeats} requests after a warm-up, 16 samples, 2 steps, 2 torch threads\n")
    print(
        "| preset | cache hits | encode s, cached | encode s, uncached "
        "| rollout s, cached | rollout s, uncached | rollout ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['hits']} | {r['cached_encode']:.4f} | {r['uncached_encode']:.4f} "
            f"| {r['cached_total']:.3f} | {r['uncached_total']:.3f} "
            f"| {r['cached_total'] / r['uncached_total']:.2f} |"
        )


if __name__ == "__main__":
    main()
