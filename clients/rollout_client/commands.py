"""The work of ``rollout-client``'s commands, loaded once its command line parsed (torch takes
seconds to import): connect, stream a rollout with a progress bar, write it to disk."""

import argparse
import fnmatch
import io
import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from google.protobuf import json_format
from PIL import Image as PILImage
from tqdm import tqdm

from rollout.v1 import rollout_pb2
from rollout_client.client import RolloutClient
from rollout_client.credentials import TLS, read_token
from rollout_client.events import Event, Finished, Started, Step
from rollout_client.images import contact_sheet
from rollout_client.trajectory import Trajectory, collect
from rollout_core import checksum, dtypes

FINISHED_FIELDS = rollout_pb2.RolloutFinished.DESCRIPTOR.fields
# Animated previews of video samples play at 16 frames per second, as Wan exports its videos.
PREVIEW_FRAME_MS = 1000 // 16


def connect(args: argparse.Namespace) -> RolloutClient:
    """The client the connection options describe; ValueError or OSError for an unusable file."""
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        tls = TLS(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    token = read_token(args.token_file) if args.token_file else None
    return RolloutClient(args.address, timeout=args.timeout, tls=tls, token=token)


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
                "audio": f"sample-{t.sample_index}.wav" if t.audio_wav else None,
                "stream_log_probs": {name: _finite_or_none(v) for name, v in t.stream_log_probs.items()},
                "trajectory": f"sample-{t.sample_index}.safetensors",
            }
            for t in trajectories
        ],
        # Timings, peak memory and streamed tensor bytes.
        "finished": {field.name: getattr(finished.message, field.name) for field in FINISHED_FIELDS},
        # The resolved request in protobuf's JSON mapping (64-bit integers are strings there).
        "request": json_format.MessageToDict(resolved, preserving_proto_field_name=True),
    }


def run_search(client: RolloutClient, request: rollout_pb2.RolloutRequest, args: argparse.Namespace):
    """``--search``: the step-wise search of ``request`` (``rollout_client.search.step_search``) with
    ``--reward``'s reward; ValueError for a reward spec that does not load."""
    from rollout_client.search import step_search
    from rollout_client.train.rewards import Rewards

    try:
        reward = Rewards(args.reward)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--reward {args.reward}: {error}") from None
    return step_search(client, request, reward, args.search, args.search_steps)


def save_rollout(
    out: Path,
    events: list[Event],
    condition_images: Sequence[bytes] = (),
    trajectories: list[Trajectory] | None = None,
    notes: dict[str, Any] | None = None,
) -> list[Trajectory]:
    """Write images (a video's first frame), animated previews of videos, each sample's sound (a WAV,
    for families that generate it), trajectories, the contact sheet (a row per prompt, labelled with
    it; the prompt's conditioning image first when the request had ``condition_images``) and
    rollout.json into ``out``: of every sample of ``events``, or of ``trajectories`` of them (a search's
    kept leaves), with ``notes``' entries added to rollout.json."""
    if trajectories is None:
        trajectories = collect(events, condition_images)
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
        if t.audio_wav:
            (out / f"sample-{t.sample_index}.wav").write_bytes(t.audio_wav)
    if images:
        resolved = started.message.resolved
        columns = resolved.samples_per_prompt
        if condition_images:  # each row: the input, then the prompt's samples
            inputs = [PILImage.open(io.BytesIO(data)) for data in condition_images]
            images = [
                image
                for p, row in enumerate(inputs)
                for image in (row, *images[p * columns : (p + 1) * columns])
            ]
            columns += 1
        sheet = contact_sheet(images, columns=columns, row_labels=resolved.prompts)
        sheet.save(out / "contact-sheet.png")
    document = {**summary(started, finished, trajectories), **(notes or {})}
    (out / "rollout.json").write_text(json.dumps(document, indent=2) + "\n")
    return trajectories


def run_conformance(client: RolloutClient, args: argparse.Namespace) -> tuple[str, bool]:
    """Send each conformance case to the server and check its stream: the table, and whether every
    row passed. ValueError when ``--model`` is not the policy the server serves."""
    from rollout_client import conformance

    info = client.server_info()
    height, width, frames = conformance.default_size(info)
    size = (args.height or height, args.width or width, args.frames or frames)
    cases = [
        case
        for case in conformance.cases(info)
        if not args.case or any(fnmatch.fnmatchcase(case.name, pattern) for pattern in args.case)
    ]
    if not cases:
        raise ValueError(f"no conformance case matches {' or '.join(args.case)}")
    transformers = _served_transformers(args.model, info, args.device) if args.model else None
    # Sent a few at a time, as many as fill one forward (and never more than the server queues): the
    # server batches their rows as it would a trainer's. Each stream is checked alone, so how it shared
    # its forwards changes nothing the checks compare beyond the rounding their bounds allow.
    limits = info.limits
    together = min(
        len(cases), max(1, limits.max_batch_size // conformance.SAMPLES), limits.max_queued_requests
    )
    with ThreadPoolExecutor(max_workers=max(1, together)) as pool:
        streams = list(
            pool.map(lambda case: list(client.stream(conformance.request(info, case, size))), cases)
        )
    results = [
        conformance.check(case, events, transformers, args.device)
        for case, events in zip(cases, streams, strict=True)
    ]
    return conformance.table(results), all(result.passed for result in results)


def _served_transformers(folder: Path, info: rollout_pb2.GetServerInfoResponse, device: str):
    """The transformers of the model folder by component, in the server's dtype, checked to be the
    policy it serves (its weights checksum): a replay through other weights would only disagree."""
    from diffusers import AutoModel  # the trainer's side; the client library never imports diffusers

    dtype = dtypes.BY_NAME[info.dtype]
    transformers = {
        name: AutoModel.from_pretrained(str(folder), subfolder=name, torch_dtype=dtype).to(device).eval()
        for name in info.transformers
    }
    served = checksum.weights_checksum(
        checksum.policy_tensors({name: checksum.base_tensors(t) for name, t in transformers.items()})
    )
    if served != info.weights_checksum:
        raise ValueError(
            f"the transformers of {folder} (checksum {served}) are not the policy the server serves "
            f"({info.weights_checksum}): replaying through them would not compare like with like"
        )
    return transformers
