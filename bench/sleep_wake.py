"""Sleep and wake: how long a server takes to release its weights' memory (ReleaseMemory) and to resume
it (ResumeMemory), and the server's resident memory before, released and resumed.

A fresh server on the model serves one small rollout first (so its resident set holds what serving
takes), then releases and resumes ``--repeats`` times. Each row is one cycle: the call's wall time
(client side, the gRPC round trip included) and the server's own ``seconds``, and the resident set
(``VmRSS``) of the server process after each call. On a CPU the weights go to a file in the server's
temporary folder and come back from it; on an accelerator to host memory.

    python bench/sleep_wake.py                   # small-flux, 3 cycles
    python bench/sleep_wake.py --model tiny-flux --repeats 5
"""

import argparse
import os
import re
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout_client import RolloutClient
from rollout_core.local_server import LocalServer

ROLLOUT = {"prompts": ["a red fox"], "samples_per_prompt": 1, "num_steps": 2, "height": 64, "width": 64}


def resident_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)[1]) / 1024


def measure(model: str, repeats: int, threads: int, cache_dir: Path | None) -> list[dict]:
    cache = ["--cache-dir", str(cache_dir)] if cache_dir else []
    with tempfile.TemporaryDirectory() as scratch:
        server = LocalServer.start(
            Path(scratch) / "server.log", "--model", model, "--threads", str(threads), *cache
        )
        pid = server.process.pid
        rows = []
        try:
            with RolloutClient(server.address, timeout=600) as client:
                client.rollout(**ROLLOUT)
                for cycle in range(repeats):
                    row = {"cycle": cycle, "resident": resident_mib(pid)}
                    for call, name in ((client.release_memory, "release"), (client.resume_memory, "resume")):
                        started = time.perf_counter()
                        residency = call()
                        row[f"{name}_wall"] = time.perf_counter() - started
                        row[f"{name}_server"] = residency.seconds
                        row[f"{name}_rss"] = resident_mib(pid)
                        row["mib"] = residency.bytes / 2**20
                    rows.append(row)
                client.rollout(**ROLLOUT)  # it serves again
        finally:
            server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-flux", help="a preset or model folder")
    parser.add_argument("--repeats", type=int, default=3, help="release and resume cycles")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    rows = measure(args.model, args.repeats, args.threads, args.cache_dir)
    print(f"{args.model}: {rows[0]['mib']:.1f} MiB of weights released and resumed per cycle\n")
    print("| cycle | release s (server) | resume s (server) | resident MiB: before | released | resumed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['cycle']} | {r['release_wall']:.3f} ({r['release_server']:.3f}) | "
            f"{r['resume_wall']:.3f} ({r['resume_server']:.3f}) | {r['resident']:.0f} | "
            f"{r['release_rss']:.0f} | {r['resume_rss']:.0f} |"
        )


if __name__ == "__main__":
    main()
