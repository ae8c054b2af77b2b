"""``rollout-server serve``: start the gRPC server on a model preset or a local diffusers folder.
``rollout-server ray``: start replicas of it as Ray actors and print their addresses.

The command line is parsed and checked before torch and diffusers load (they take seconds), so
``--help`` and argument errors answer at once; the modules imported here stay light.
"""

import argparse
import asyncio
import atexit
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from rollout.v1 import rollout_pb2
from rollout_server.auth import ServerTLS, TokenPolicy, load_token
from rollout_server.errors import ParallelismUnsupported, RankFailure, StartupError, UnsupportedModel
from rollout_server.limits import (
    DEFAULT_HTTP_READ_SECONDS,
    DEFAULT_MAX_HTTP_RESPONSE_BYTES,
    Limits,
    parse_bytes,
)
from rollout_server.presets import preset_names, resolve_model
from rollout_server.prompt_cache import DEFAULT_PROMPT_CACHE_ENTRIES

# The model dtypes are those latents stream in (rollout_core.dtypes.MODEL_DTYPE_NAMES, which loads
# torch): the TensorDtype names, lower case.
MODEL_DTYPES = tuple(
    name.removeprefix("TENSOR_DTYPE_").lower() for name, number in rollout_pb2.TensorDtype.items() if number
)
# How --sp ranks split attention: rollout_server.parallel.ATTENTION_SPLITS, not imported (it loads torch).
ATTENTION_SPLITS = ("ulysses", "ring", "ulysses+ring")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rollout-server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("serve", help="serve rollouts over gRPC")
    presets = ", ".join(preset_names())
    s.add_argument("--model", default="tiny-flux", help=f"preset name ({presets}) or a diffusers folder")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=50051, help="port (0 picks a free one)")
    s.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    s.add_argument("--dtype", default="float32", choices=MODEL_DTYPES)
    s.add_argument("--cache-dir", type=Path, default=None, help="where presets are built (default: ~/.cache)")
    s.add_argument("--grace-seconds", type=float, default=10.0, help="time running rollouts get at shutdown")
    s.add_argument("--max-message-bytes", type=int, default=Limits.max_message_bytes)
    s.add_argument(
        "--max-batch-size",
        type=int,
        default=Limits.max_batch_size,
        help="transformer rows per forward (a sample in one CFG branch), across concurrent rollouts; "
        "1 turns batching off",
    )
    s.add_argument("--max-samples", type=int, default=Limits.max_samples, help="samples per request")
    s.add_argument(
        "--max-queued", type=int, default=Limits.max_queued_requests, help="rollouts queued or running"
    )
    s.add_argument(
        "--max-running-samples",
        type=int,
        default=Limits.max_running_samples,
        help="samples of the rollouts stepping together (a larger rollout runs alone)",
    )
    s.add_argument(
        "--max-tree-nodes",
        type=int,
        default=Limits.max_tree_nodes,
        help="nodes of a tree rollout (its leaves are bounded by --max-running-samples)",
    )
    s.add_argument(
        "--max-latent-elements",
        type=int,
        default=Limits.max_latent_elements,
        help="elements of one sample's latent, whatever its frames and size",
    )
    s.add_argument(
        "--max-waiting",
        type=int,
        default=Limits.max_waiting_requests,
        help="requests waiting for their min_policy_version (they hold no rollout slot)",
    )
    s.add_argument(
        "--stall-seconds",
        type=float,
        default=Limits.stall_seconds,
        help="end a stream (ABORTED) whose client has read nothing for this long, freeing its work; "
        "an HTTP client that takes too little of its answer for this long is dropped",
    )
    s.add_argument(
        "--prune-hold-seconds",
        type=float,
        default=Limits.prune_hold_seconds,
        help="the longest a tree rollout waits at one of its prune points for its caller's prune",
    )
    s.add_argument(
        "--memory-budget",
        type=byte_size,
        default=None,
        help="bytes the running rollouts may take above the loaded model, e.g. 12GiB (default: half the "
        "RAM available once the model is loaded on a CPU, 80%% of the free GPU memory on CUDA). Each "
        "request's estimate counts what it holds (latents, sampler tensors, stream, env, a video "
        "decode's cache) and the largest piece of work: a forward, a decode piece or a conditioning "
        "image's encode, the VAE's measured at start-up on a probe (on a CPU with what glibc's heap "
        "keeps); a request that cannot fit alone is refused",
    )
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (per rank)")
    s.add_argument(
        "--sp", type=int, default=1, help="sequence-parallel ranks (processes) to run the model on"
    )
    s.add_argument("--attention-split", default="ulysses", choices=ATTENTION_SPLITS, help="with --sp > 1")
    s.add_argument(
        "--collective-timeout",
        type=float,
        default=120.0,
        help="seconds before a silent rank is declared failed",
    )
    s.add_argument(
        "--weights-root",
        type=Path,
        default=None,
        help="folder LoadWeights may read policy weights from (default: LoadWeights disabled)",
    )
    s.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS (with --tls-key)")
    s.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    s.add_argument(
        "--tls-client-ca", type=Path, help="PEM CA: require client certificates it signed (mutual TLS)"
    )
    s.add_argument(
        "--auth-token-file", type=Path, help="file with the bearer token for Rollout and GetServerInfo"
    )
    s.add_argument(
        "--admin-token-file",
        type=Path,
        help="file with the bearer token for UpdateWeights and LoadWeights (it also allows rollouts)",
    )
    s.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve SGLang-Diffusion's HTTP rollout API (POST /rollout/generate) on this port, with "
        "the same --host, TLS files and tokens (0 picks a free one; default: off)",
    )
    s.add_argument(
        "--max-http-response-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_HTTP_RESPONSE_BYTES,
        help="the largest answer of the HTTP API, refused before any work (default 1GiB); an answer counts "
        "until it has left, and a client that takes too little of it for --stall-seconds is dropped",
    )
    s.add_argument(
        "--http-read-seconds",
        type=float,
        default=DEFAULT_HTTP_READ_SECONDS,
        help="seconds an HTTP request, headers and body, may take to arrive, from the connection's opening "
        "or the previous answer's end; a slower or silent connection is closed (default 30)",
    )
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    s.add_argument(
        "--prompt-cache-entries",
        type=int,
        default=DEFAULT_PROMPT_CACHE_ENTRIES,
        help="distinct prompt texts kept encoded on the model's device, least recently used out (0: off)",
    )
    s.add_argument(
        "--upload-idle-seconds",
        type=float,
        default=30.0,
        help="seconds an UpdateWeights stream may send nothing before it is dropped",
    )
    r = commands.add_parser(
        "ray",
        help="start replicas as Ray actors, print their addresses, keep them up until interrupted",
        description="Start N replicas of `rollout-server serve` as Ray actors (restarted by Ray when they "
        "die), print one address per line, and keep them up until SIGINT or SIGTERM. Arguments after "
        "`--` go to every `rollout-server serve`.",
    )
    r.add_argument("--replicas", type=int, required=True)
    r.add_argument("--model", default="tiny-flux", help="preset name or a diffusers folder on every node")
    r.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks per replica")
    r.add_argument("--device", default="cpu", help="cpu, or cuda (each replica then gets --sp GPUs)")
    r.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    r.add_argument("--base-port", type=int, default=50100, help="replica k listens on base-port + k")
    r.add_argument("--cpus-per-replica", type=float, default=1.0)
    r.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then arguments for rollout-server serve")
    return parser.parse_args(argv)


def byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run_ray(args: argparse.Namespace) -> None:
    try:
        from rollout_server.ray import connect, launch, wait_forever
    except ImportError:
        sys.exit("rollout-server ray: Ray is not installed (pip install 'rollout-server[ray]')")
    if args.replicas < 1 or args.sp < 1:
        sys.exit("rollout-server ray: --replicas and --sp must be at least 1")
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    connect(args.address)
    replicas = launch(
        args.replicas,
        args.model,
        sp=args.sp,
        device=args.device,
        serve_args=serve_args,
        base_port=args.base_port,
        cpus_per_replica=args.cpus_per_replica,
    )
    print("\n".join(replicas.addresses), flush=True)
    wait_forever(replicas)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "ray":
        return run_ray(args)
    limits = Limits(
        max_samples=args.max_samples,
        max_batch_size=args.max_batch_size,
        max_message_bytes=args.max_message_bytes,
        max_queued_requests=args.max_queued,
        max_running_samples=args.max_running_samples,
        max_latent_elements=args.max_latent_elements,
        max_waiting_requests=args.max_waiting,
        stall_seconds=args.stall_seconds,
        prune_hold_seconds=args.prune_hold_seconds,
        memory_budget=args.memory_budget,
        max_tree_nodes=args.max_tree_nodes,
    )
    try:
        limits.check()
    except ValueError as error:
        sys.exit(f"rollout-server: {error}")
    if not 0 < args.collective_timeout <= 120:
        sys.exit("rollout-server: --collective-timeout must be in (0, 120] seconds")
    if args.prompt_cache_entries < 0:
        sys.exit("rollout-server: --prompt-cache-entries must be 0 (off) or more")
    if not args.upload_idle_seconds > 0:
        sys.exit("rollout-server: --upload-idle-seconds must be above 0")
    if not args.http_read_seconds > 0:
        sys.exit("rollout-server: --http-read-seconds must be above 0")
    if args.http_port is not None and not 0 <= args.http_port <= 65535:
        sys.exit("rollout-server: --http-port must be in [0, 65535]")
    if args.weights_root is not None and not args.weights_root.is_dir():
        sys.exit(f"rollout-server: --weights-root {args.weights_root} is not a folder")
    try:
        tls = ServerTLS.load(args.tls_cert, args.tls_key, args.tls_client_ca)
        tokens = TokenPolicy(
            rollout_token=load_token(args.auth_token_file, "--auth-token-file"),
            admin_token=load_token(args.admin_token_file, "--admin-token-file"),
        )
    except StartupError as error:
        sys.exit(f"rollout-server: {error}")

    # The command line is good: load the model libraries.
    import diffusers
    import torch

    from rollout_server.parallel import fork_ranks, plan, start
    from rollout_server.server import ServerOptions, follow, serve

    diffusers.utils.logging.disable_progress_bar()  # "Loading pipeline components" while the model loads
    try:
        dims = plan(args.sp, args.attention_split, args.device)
    except (ValueError, ParallelismUnsupported) as error:
        sys.exit(f"rollout-server: {error}")
    helpers = fork_ranks(dims)  # before torch starts its thread pools
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        # Before torch.distributed starts: transformers' save_pretrained writes nothing on ranks > 0.
        model_path = resolve_model(args.model, args.cache_dir)
    except FileNotFoundError as error:
        sys.exit(f"rollout-server: cannot load model {args.model!r}: {error}")
    try:
        parallel = start(dims, args.collective_timeout, args.device, helpers)
    except (ValueError, ParallelismUnsupported) as error:
        sys.exit(f"rollout-server: {error}")
    options = ServerOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        grace_seconds=args.grace_seconds,
        limits=limits,
        cache_dir=args.cache_dir,
        model_path=model_path,
        parallel=parallel,
        weights_root=args.weights_root.resolve() if args.weights_root else None,
        tls=tls,
        tokens=tokens,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        upload_idle_seconds=args.upload_idle_seconds,
        prompt_cache_entries=args.prompt_cache_entries,
        http_port=args.http_port,
        max_http_response_bytes=args.max_http_response_bytes,
        http_read_seconds=args.http_read_seconds,
    )
    try:
        code = asyncio.run(serve(options)) if parallel.is_leader else follow(options)
    except UnsupportedModel as error:
        code = f"rollout-server: cannot load model {args.model!r}: {error}"
    except (StartupError, ParallelismUnsupported) as error:
        code = f"rollout-server: {error}"
    except RankFailure as error:
        code = f"rollout-server rank {parallel.rank}: {error}"
    finally:
        parallel.shutdown()
    sys.exit(code)


def run() -> NoReturn:
    """The ``rollout-server`` command: ``main``, then the process exits without the interpreter's
    teardown of every module (torch's takes seconds), once the exit handlers ran and the logs are
    flushed: the server has closed everything it opened by then."""
    try:
        main()
        code = 0
    except SystemExit as exit:
        code = exit.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    run()
