"""rollout-client: inspect a rollout server and save rollouts to disk.

    rollout-client info [--address HOST:PORT] [--tls-ca CA.pem] [--token-file FILE]
    rollout-client rollout "a red fox" "a blue bird" --samples-per-prompt 4 --seed 7 --out rollouts/
    rollout-client rollout "a red circle" --search 4 --reward MODULE:CALLABLE --out searched/
    rollout-client conformance HOST:PORT [--model FOLDER]

The rollout command writes, per sample k, sample-<k>.png and sample-<k>.safetensors (a Trajectory),
plus contact-sheet.png (one row per prompt) and rollout.json (seeds, schedule, log-probs, timings).
Options left out are left unset in the request, so the server's defaults apply.

With --search K the rollout is a step-wise search (rollout_client.search): at each of --search-steps
it branches K ways, scores each child's preview (its decoded x0_hat) with --reward and prunes all but
the best of each sample, so one path a sample continues; it saves the kept samples and prints the
transformer forwards it spent beside plain sampling's (rollout.json's "search" has its decisions).

The conformance command sends the conformance kit's rollouts (each sampler x CFG mode x solver window)
and checks every stream: the noise against the seed rule, the log-probs and the deterministic steps
against the formulas, from the streamed velocities or, with --model, from the model's own forwards. It
prints a table and exits 3 when a row fails.

The command line is parsed before the client library loads (it imports torch, which takes seconds),
so --help and usage errors answer at once.
"""

import argparse
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from rollout.v1 import rollout_pb2

DEFAULT_ADDRESS = "127.0.0.1:50051"
# RolloutRequest fields set from the options of the same name, when given.
REQUEST_FIELDS = (
    "samples_per_prompt",
    "base_seed",
    "num_steps",
    "height",
    "width",
    "num_frames",
    "sampler",
    "noise_level",
    "guidance_scale",
    "guidance_scale_2",
    "boundary_ratio",
    "true_cfg_scale",
    "negative_prompt",
    "stochastic_steps",
    "latents",
    "latent_dtype",
)
# Enum options: the choice "around-stochastic" of --latents is LATENT_SELECTION_AROUND_STOCHASTIC.
ENUM_PREFIXES = {"sampler": "SAMPLER_TYPE_", "latents": "LATENT_SELECTION_", "latent_dtype": "TENSOR_DTYPE_"}
# The latent dtypes (rollout_core.dtypes.MODEL_DTYPE_NAMES, which loads torch): the TensorDtype
# names, lower case.
LATENT_DTYPES = tuple(
    name.removeprefix("TENSOR_DTYPE_").lower() for name, number in rollout_pb2.TensorDtype.items() if number
)
EXIT_RPC_ERROR = 2
EXIT_USAGE = 1
EXIT_NONCONFORMANT = 3


def _unsigned(bits: int):
    def parse(text: str) -> int:
        value = int(text)
        if not 0 <= value < 1 << bits:
            raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**{bits}), got {text}")
        return value

    parse.__name__ = f"uint{bits}"
    return parse


def _step_list(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2] (an empty list means every step is stochastic)."""
    parse = _unsigned(32)
    return [parse(item) for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"server address (default {DEFAULT_ADDRESS})"
    )
    common.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    common.add_argument(
        "--tls", action="store_true", help="connect over TLS (implied by the --tls-* options below)"
    )
    common.add_argument("--tls-ca", type=Path, help="PEM CA of the server's certificate (default: system)")
    common.add_argument("--tls-cert", type=Path, help="PEM client certificate, for mutual TLS")
    common.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    common.add_argument("--token-file", type=Path, help="file holding the bearer token to present")

    parser = argparse.ArgumentParser(
        prog="rollout-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", parents=[common], help="print GetServerInfo as JSON")

    r = commands.add_parser("rollout", parents=[common], help="run a rollout and save it to --out")
    r.add_argument("prompts", nargs="+", metavar="PROMPT", help="one GRPO group per prompt")
    r.add_argument("--out", type=Path, required=True, help="output folder (created if missing)")
    r.add_argument("--samples-per-prompt", type=_unsigned(32), metavar="N", help="group size")
    r.add_argument(
        "--seed",
        dest="base_seed",
        type=_unsigned(64),
        metavar="BASE",
        help="base seed; sample k gets splitmix64(BASE + k)",
    )
    r.add_argument("--steps", dest="num_steps", type=_unsigned(32), metavar="T", help="denoising steps")
    r.add_argument("--height", type=_unsigned(32), help="image height in pixels")
    r.add_argument("--width", type=_unsigned(32), help="image width in pixels")
    r.add_argument(
        "--frames", dest="num_frames", type=_unsigned(32), help="video frames per sample (4k + 1 for Wan)"
    )
    r.add_argument("--sampler", choices=("flow-sde", "dance", "cps", "ode"), help="step rule")
    r.add_argument("--noise-level", type=float, help="noise level a of the stochastic steps")
    r.add_argument(
        "--guidance",
        dest="guidance_scale",
        type=float,
        help="guidance_scale: embedded guidance (FLUX.1 [dev], FLUX.2 [dev]), or the CFG scale where it is "
        "the model's cfg_scale_field (SD3, Wan, ...)",
    )
    r.add_argument(
        "--guidance-2",
        dest="guidance_scale_2",
        type=float,
        help="Wan 2.2: the CFG scale of the low-noise expert's steps (default: --guidance)",
    )
    r.add_argument(
        "--boundary-ratio",
        type=float,
        help="Wan 2.2: the low-noise expert runs the steps whose timestep is below this x 1000",
    )
    r.add_argument("--true-cfg", dest="true_cfg_scale", type=float, help="true CFG scale (> 1 enables it)")
    r.add_argument("--negative-prompt", help="negative prompt for true CFG")
    r.add_argument(
        "--image",
        dest="images",
        type=Path,
        action="append",
        metavar="FILE",
        help="conditioning image (PNG or JPEG) of an editing or image-to-video model: one per prompt, "
        "in order, or one for every prompt",
    )
    r.add_argument(
        "--stochastic-steps",
        type=_step_list,
        metavar="I,J,...",
        help="indices of the stochastic steps (default: all)",
    )
    r.add_argument(
        "--latents",
        choices=("all", "around-stochastic", "final-only", "none"),
        help="which latents to stream",
    )
    r.add_argument("--latent-dtype", choices=LATENT_DTYPES, help="streamed latent dtype")
    r.add_argument(
        "--search",
        type=_unsigned(32),
        metavar="K",
        help="step-wise search: branch K ways at each --search-steps step and keep, per sample, the child "
        "whose preview --reward scores best (the others are pruned); needs --reward",
    )
    r.add_argument(
        "--search-steps",
        type=_step_list,
        metavar="I,J,...",
        help="the steps --search branches at, stochastic ones (default: the earliest steps whose tree fits "
        "the server's limits)",
    )
    r.add_argument(
        "--reward",
        metavar="SPEC",
        help="--search's reward: module:callable[*weight] terms, comma-separated, as the trainer's --reward "
        "(e.g. rollout_client.rewards.shapes:geneval_reward)",
    )

    c = commands.add_parser(
        "conformance", parents=[common], help="check a server's rollouts against the protocol's formulas"
    )
    c.add_argument("server", nargs="?", metavar="ADDRESS", help="server address (default: --address)")
    c.add_argument(
        "--model",
        type=Path,
        metavar="FOLDER",
        help="the served model's diffusers folder: replay through its transformers (loaded in the "
        "server's dtype, checked against its weights checksum) instead of the streamed velocities",
    )
    c.add_argument("--device", default="cpu", help="where --model's transformers run (default cpu)")
    c.add_argument(
        "--height",
        type=_unsigned(32),
        help="image height (default 2 x limits.side_multiple, at least min_side)",
    )
    c.add_argument(
        "--width",
        type=_unsigned(32),
        help="image width (default 2 x limits.side_multiple, at least min_side)",
    )
    c.add_argument("--frames", type=_unsigned(32), help="video frames per sample (default 1)")
    c.add_argument(
        "--case",
        action="append",
        metavar="PATTERN",
        help="only the cases whose name SAMPLER/CFG/WINDOW (e.g. 'CPS/cfg/sde 2 in unipc', as the table's "
        "rows) matches this shell-style pattern; repeatable",
    )
    args = parser.parse_args(argv)
    if getattr(args, "server", None):
        args.address = args.server
    if args.command == "rollout":
        if args.search is None and (args.search_steps is not None or args.reward is not None):
            r.error("--search-steps and --reward go with --search")
        if args.search is not None and (args.search < 1 or not args.reward):
            r.error("--search K needs K >= 1 and a --reward")
    return args


def build_request(args: argparse.Namespace) -> rollout_pb2.RolloutRequest:
    """The RolloutRequest of the given options; options left out stay unset."""
    fields = {name: getattr(args, name) for name in REQUEST_FIELDS if getattr(args, name) is not None}
    for name, prefix in ENUM_PREFIXES.items():
        if name in fields:
            fields[name] = prefix + fields[name].upper().replace("-", "_")
    images = args.images or []
    if len(images) not in (0, 1, len(args.prompts)):
        raise ValueError(
            f"{len(images)} --image files for {len(args.prompts)} prompts: one per prompt, or one"
        )
    files = [path.read_bytes() for path in images]
    if len(files) == 1:
        files *= len(args.prompts)
    fields["condition_images"] = [rollout_pb2.ConditionImage(data=data) for data in files]
    return rollout_pb2.RolloutRequest(prompts=args.prompts, **fields)


def describe_error(error: grpc.RpcError) -> str:
    """One line: the status code, then the BadRequest field violations or else the details."""
    status = rpc_status.from_call(error)
    violations = []
    for detail in status.details if status else []:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            violations += [f"{v.field}: {v.description}" for v in bad_request.field_violations]
    text = "; ".join(violations) or error.details() or ""
    return f"{error.code().name}: {' '.join(text.split())}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rollout_client.commands import (
        connect,
        run_conformance,
        run_search,
        save_rollout,
        stream_with_progress,
    )

    try:
        client = connect(args)
    except (ValueError, OSError) as error:
        print(f"rollout-client: {error}", file=sys.stderr)
        return EXIT_USAGE
    with client:
        try:
            if args.command == "info":
                print(json_format.MessageToJson(client.server_info(), preserving_proto_field_name=True))
                return 0
            if args.command == "conformance":
                table, passed = run_conformance(client, args)
                print(table)
                return 0 if passed else EXIT_NONCONFORMANT
            request = build_request(args)
            search = run_search(client, request, args) if args.search is not None else None
            events = search.events if search else stream_with_progress(client, request)
        except (ValueError, OSError) as error:
            print(f"rollout-client: {error}", file=sys.stderr)
            return EXIT_USAGE
        except grpc.RpcError as error:
            print(f"rollout-client: {describe_error(error)}", file=sys.stderr)
            return EXIT_RPC_ERROR
    condition_images = [image.data for image in request.condition_images]
    if search is None:
        trajectories = save_rollout(args.out, events, condition_images)
    else:
        summary = search.summary()
        trajectories = save_rollout(
            args.out, events, condition_images, search.trajectories, {"search": summary}
        )
        print(
            f"search: {summary['forwards']} transformer forwards, plain sampling {summary['plain_forwards']} "
            f"({summary['forwards'] / summary['plain_forwards']:.2f} x)"
        )
    print(f"wrote {len(trajectories)} samples to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
