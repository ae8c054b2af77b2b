"""rollout-client: inspect a rollout server and save rollouts to disk.

    rollout-client info [--address HOST:PORT] [--tls-ca CA.pem] [--token-file FILE]
    rollout-client rollout "a red fox" "a blue bird" --samples-per-prompt 4 --seed 7 --out rollouts/

The rollout command writes, per sample k, sample-<k>.png and sample-<k>.safetensors (a Trajectory),
plus contact-sheet.png (one row per prompt) and rollout.json (seeds, schedule, log-probs, timings).
Options left out are left unset in the request, so the server's defaults apply.
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from tqdm import tqdm

from rollout.v1 import rollout_pb2
from rollout_client.client import RolloutClient
from rollout_client.credentials import TLS, read_token
from rollout_client.events import Event, Finished, Started, Step
from rollout_client.images import contact_sheet
from rollout_client.trajectory import Trajectory, collect
from rollout_core import dtypes

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
    "true_cfg_scale",
    "negative_prompt",
    "stochastic_steps",
    "latents",
    "latent_dtype",
)
# Enum options: the choice "around-stochastic" of --latents is LATENT_SELECTION_AROUND_STOCHASTIC.
ENUM_PREFIXES = {"sampler": "SAMPLER_TYPE_", "latents": "LATENT_SELECTION_", "latent_dtype": "TENSOR_DTYPE_"}
FINISHED_FIELDS = rollout_pb2.RolloutFinished.DESCRIPTOR.fields
EXIT_RPC_ERROR = 2
EXIT_USAGE = 1
# Animated previews of video samples play at 16 frames per second, as Wan exports its videos.
PREVIEW_FRAME_MS = 1000 // 16


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
    r.add_argument("--guidance", dest="guidance_scale", type=float, help="embedded (distilled) guidance")
    r.add_argument("--true-cfg", dest="true_cfg_scale", type=float, help="true CFG scale (> 1 enables it)")
    r.add_argument("--negative-prompt", help="negative prompt for true CFG")
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
    r.add_argument("--latent-dtype", choices=dtypes.MODEL_DTYPE_NAMES, help="streamed latent dtype")
    return parser.parse_args(argv)


def build_request(args: argparse.Namespace) -> rollout_pb2.RolloutRequest:
    """The RolloutRequest of the given options; options left out stay unset."""
    fields = {name: getattr(args, name) for name in REQUEST_FIELDS if getattr(args, name) is not None}
    for name, prefix in ENUM_PREFIXES.items():
        if name in fields:
            fields[name] = prefix + fields[name].upper().replace("-", "_")
    return rollout_pb2.RolloutRequest(prompts=args.prompts, **fields)


def stream_with_progress(client: RolloutClient, request: rollout_pb2.RolloutRequest) -> list[Event]:
    """All events of the rollout, with a progress bar over the denoising steps on stderr."""
    events: list[Event] = []
    bar = None
    try:
        for event in client.stream(request):
            events.append(event)
            if isinstance(event, Started):
                bar = tqdm(total=len(event.message.stochastic), desc="denoising", unit="step")
            elif isinstance(event, Step):
                if event.log_probs is not None:
                    bar.set_postfix(log_prob=f"{event.log_probs.mean().item():.4f}", refresh=False)
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    return events


def _finite_or_none(values: torch.Tensor) -> list[float | None]:
    """JSON has no NaN: steps without a log-prob become null."""
    return [None if math.isnan(v) else v for v in values.tolist()]


def summary(started: Started, finished: Finished, trajectories: list[Trajectory]) -> dict[str, Any]:
    """The rollout.json document."""
    message = started.message
    resolved = message.resolved
    return {
        "request_id": started.request_id,
        "model": message.model,
        "family": message.family,
        "policy_version": message.policy_version,
        "prompts": list(resolved.prompts),
        "seeds": list(message.seeds),
        "log_prob_constants": message.log_prob_constants,
        "sigmas": list(message.sigmas),
        "timesteps": list(message.timesteps),
        "stochastic": list(message.stochastic),
        "samples": [
            {
                "index": t.sample_index,
                "prompt_index": t.prompt_index,
                "seed": t.seed,
                "log_probs": _finite_or_none(t.log_probs),
                "latents_streamed": t.latent_mask.nonzero().flatten().tolist(),
                "image": f"sample-{t.sample_index}.png" if t.image_png else None,
                "frames": len(t.frames_png),
                "preview": f"sample-{t.sample_index}.gif" if len(t.frames_png) > 1 else None,
                "trajectory": f"sample-{t.sample_index}.safetensors",
            }
            for t in trajectories
        ],
        # Timings, peak memory and streamed tensor bytes.
        "finished": {field.name: getattr(finished.message, field.name) for field in FINISHED_FIELDS},
        # The resolved request in protobuf's JSON mapping (64-bit integers are strings there).
        "request": json_format.MessageToDict(resolved, preserving_proto_field_name=True),
    }


def save_rollout(out: Path, events: list[Event]) -> list[Trajectory]:
    """Write images (a video's first frame), animated previews of videos, trajectories, the contact
    sheet and rollout.json into ``out``."""
    trajectories = collect(events)
    started = next(e for e in events if isinstance(e, Started))
    finished = next(e for e in events if isinstance(e, Finished))
    out.mkdir(parents=True, exist_ok=True)
    images = []
    for t in trajectories:
        t.save(out / f"sample-{t.sample_index}.safetensors")
        if t.image_png:
            (out / f"sample-{t.sample_index}.png").write_bytes(t.image_png)
            images.append(t.image())
        if len(t.frames_png) > 1:
            frames = t.frames()
            preview = out / f"sample-{t.sample_index}.gif"
            frames[0].save(
                preview, save_all=True, append_images=frames[1:], duration=PREVIEW_FRAME_MS, loop=0
            )
    if images:
        sheet = contact_sheet(images, columns=started.message.resolved.samples_per_prompt)
        sheet.save(out / "contact-sheet.png")
    document = summary(started, finished, trajectories)
    (out / "rollout.json").write_text(json.dumps(document, indent=2) + "\n")
    return trajectories


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


def connect(args: argparse.Namespace) -> RolloutClient:
    """The client the connection options describe; ValueError or OSError for an unusable file."""
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        tls = TLS(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    token = read_token(args.token_file) if args.token_file else None
    return RolloutClient(args.address, timeout=args.timeout, tls=tls, token=token)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
            events = stream_with_progress(client, build_request(args))
        except grpc.RpcError as error:
            print(f"rollout-client: {describe_error(error)}", file=sys.stderr)
            return EXIT_RPC_ERROR
    trajectories = save_rollout(args.out, events)
    print(f"wrote {len(trajectories)} samples to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
