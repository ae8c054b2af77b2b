"""What a rollout's work takes in memory, estimated at admission and checked against a budget.

A rollout holds, from the round it joins to its end: its latents and the sampler's float32 tensors
(the state, each CFG branch's velocity, the guided velocity, the step's mean, noise and next latent),
the messages of its stream (an event's tensors, their safetensors buffer and the messages cut from
it, and the outbox's backlog) and its prompts' env. On top of that, one piece of work runs at a time
on the worker: a transformer forward (at most ``max_batch_size`` rows of one shape, and no more
latent elements than ``max_latent_elements`` allows, as the runner cuts them; under sequence
parallelism each rank runs its share of the forward's tokens), one decode piece (one image, one chunk
of a video's frames or a whole video, as the VAE decodes it, or a sample's sound: of the final
latents or of a preview's x0_hat) or one conditioning image's encode. The per-family sizes come from
the adapter (``forward_activation``, ``text_elements``, ``audio_values``). A forward's live tensors
per widest activation were measured on the tiny presets (docs/architecture.md has the table); the
VAE's work is measured at start-up on a probe (``measure_vae``): what its tensors take per pixel,
which a piece of any size follows (on a CPU, in glibc's heap, with the convolutions' scratch). What
grows with the square of a sequence (an attention mask materialised query by key, the scores of
SDPA's math kernel) is no multiple of a pixel's bytes: the adapter counts it
(``attention_matrix_bytes``, ``decode_attention_bytes``). The text sizes are bounds: a family whose
pipeline truncates no text refuses one above them once it is tokenised (``errors.TextTooLong``),
never by its characters alone.

The estimate is an upper bound on the memory above the loaded model. Rollouts run together only
while the sum of what they hold plus the largest piece of work among them fits the budget; a
rollout that cannot fit alone is refused at admission.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch

from rollout.v1 import rollout_pb2
from rollout_core import dtypes
from rollout_core.tree import widest
from rollout_server.families.base import FamilyAdapter, MediaShape, VaeProfile

if TYPE_CHECKING:
    from rollout_server.limits import Limits

# Live tensors at a forward's peak, per element of its widest activation (tokens x width); measured on
# this repository's presets, rounded up.
FORWARD_LIVE_FACTOR = 6
# Resident memory that the first work at a new size adds besides its tensors: library code paged in
# on first use, and what the allocator keeps in its arenas (40 to 120 MiB measured on a CPU).
RUNTIME_OVERHEAD = 128 * 2**20
# A sample's float32 sampler tensors besides each branch's velocity: the state, the guided velocity,
# the step's mean, noise, scaled noise and next latent, and the solver's history (two data
# predictions and UniPC's corrected sample, rollout_core.solvers).
SAMPLER_TENSORS = 9
# Copies of an event's payload alive while it is sent: the tensors, their safetensors buffer and the
# messages cut from it.
EVENT_COPIES = 3
# A decoded frame's bytes per pixel: the float32 RGB tensor, its numpy copy and the 8-bit image.
FRAME_BYTES_PER_PIXEL = 3 * (4 + 4 + 1)
# A PIL RGB image's bytes per pixel (it stores RGBX): a video's last piece of images, which the decode
# loop still holds while the sample's sound decodes.
IMAGE_BYTES_PER_PIXEL = 4
# A decoded sound's bytes per value of its waveform (channels x samples): the float32 waveform and two
# float32 temporaries of its conversion to 16-bit PCM, then four 16-bit copies (the PCM, its
# interleaved bytes, the WAV buffer and its value; rollout_server.stream.wav_bytes).
SOUND_BYTES_PER_VALUE = 3 * 4 + 4 * 2
# A WAV file's bytes: a 44-byte header, then 16-bit PCM.
WAV_HEADER_BYTES = 44
# The default budget's share of the device memory left once the model is loaded: on a CPU host the
# RAM is shared with other processes (a trainer, often); a GPU is the server's own, less room for the
# caching allocator's fragmentation.
CPU_BUDGET_FRACTION = 0.5
CUDA_BUDGET_FRACTION = 0.8


def format_bytes(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def default_budget(device: torch.device, ranks: int) -> int:
    """The budget when ``--memory-budget`` is not given: a share of the memory the device has left
    now that the model is loaded. On a CPU the ``ranks`` sequence-parallel ranks share the host's
    RAM, each with the rollouts' latents and a forward's working set."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_BUDGET_FRACTION)
    if device.type == "cpu":
        return int(psutil.virtual_memory().available * CPU_BUDGET_FRACTION / ranks)
    raise ValueError(f"no default memory budget on {device.type}: pass --memory-budget")


@dataclass(frozen=True)
class RolloutMemory:
    """A rollout's estimated memory, in bytes."""

    held: int = 0  # from join to end: latents, sampler tensors, stream buffers, env (and a decode cache)
    row_bytes: int = 0  # one transformer row's share of a forward's working set
    rows: int = 0  # its transformer rows: samples x CFG branches
    decode_bytes: int = 0  # one decode piece's working set (0 without images or previews)
    row_elements: int = 1  # one row's latent elements, which bound the rows of a forward
    encode_bytes: int = 0  # one conditioning image's encode (0 for a family that takes none)


@dataclass(frozen=True)
class MemoryBudget:
    """The memory the running rollouts may take above the loaded model, under the server's ``limits``
    (which bound the rows of a forward)."""

    limit: int
    limits: "Limits"

    def forward_rows(self, memory: RolloutMemory, rows: int) -> int:
        """The most rows of ``memory``'s shape in one forward when ``rows`` rows run."""
        return min(rows, self.limits.rows_per_forward(memory.row_elements))

    def peak(self, rollouts: Iterable[RolloutMemory]) -> int:
        """An upper bound on the peak of ``rollouts`` running together: what each holds, plus the
        largest single piece of work, a forward, a decode piece or a conditioning image's encode,
        plus the runtime's overhead. A forward's rows share one latent shape, so they are of one
        rollout's row size, and as many as ``forward_rows`` of all the rows running."""
        rollouts = list(rollouts)
        if not rollouts:
            return 0
        rows = sum(r.rows for r in rollouts)
        forward = max(self.forward_rows(r, rows) * r.row_bytes for r in rollouts)
        largest_piece = max(forward, *(max(r.decode_bytes, r.encode_bytes) for r in rollouts))
        return RUNTIME_OVERHEAD + sum(r.held for r in rollouts) + largest_piece

    def fits(self, rollouts: Iterable[RolloutMemory]) -> bool:
        return self.peak(rollouts) <= self.limit


@dataclass(frozen=True)
class SampleSizes:
    """One sample of a resolved request: its latent's elements, the bytes of one text's env, and its
    latent streams (LTX-2: 2; 0 for a family with one latent tensor)."""

    latent_elements: int
    text_bytes: int
    latent_streams: int = 0


def sample_sizes(adapter: FamilyAdapter, request: rollout_pb2.RolloutRequest) -> SampleSizes:
    shape = MediaShape.of(request)
    return SampleSizes(
        math.prod(adapter.latent_shape(shape)),
        adapter.text_elements() * adapter.dtype.itemsize,
        len(adapter.latent_streams(shape)),
    )


def sound_piece(adapter: FamilyAdapter, vae: VaeProfile, shape: MediaShape, video_pixels: int) -> int:
    """The bytes of one sample's sound decode at ``shape``, which runs after its frames, a decode piece
    of its own (0 without sound): its decoder's tensors, the waveform and its WAV, beside the last
    video piece's images (``video_pixels``), which the decode loop still holds."""
    values = adapter.audio_values(shape)
    if not values:
        return 0
    return (
        math.ceil(values * vae.sound_bytes)
        + values * SOUND_BYTES_PER_VALUE
        + video_pixels * IMAGE_BYTES_PER_PIXEL
    )


def estimate(
    adapter: FamilyAdapter,
    vae: VaeProfile,
    request: rollout_pb2.RolloutRequest,
    backlog_bytes: int,
    sequence_split: int = 1,
) -> RolloutMemory:
    """The memory of a resolved request on ``adapter``'s model, whose VAE's work ``vae`` profiles, on
    rank 0 of ``sequence_split`` ranks that split a forward's tokens (``--sp``; the latents, env and
    stream stay whole on it); ``backlog_bytes`` bounds the messages its outbox holds from earlier
    events."""
    shape = MediaShape.of(request)
    samples = widest(request)  # a tree rollout holds its leaves' latents at the end
    branches = 2 if adapter.runs_cfg(request) else 1
    model_bytes = adapter.dtype.itemsize
    sizes = sample_sizes(adapter, request)
    latent = sizes.latent_elements * samples  # elements of the rollout's latents
    texts = len(set(request.prompts)) + (branches == 2)
    env = texts * sizes.text_bytes
    tokens, width = adapter.forward_activation(shape)
    tokens = -(-tokens // sequence_split)  # this rank's share; the generated ones split evenly
    row_bytes = (tokens * width * FORWARD_LIVE_FACTOR + adapter.text_elements()) * model_bytes
    row_bytes += adapter.attention_matrix_bytes(shape)  # whole on every rank: none is split
    decode_bytes = decode_state = wav = 0
    frame_pixels = shape.height * shape.width
    decodes = request.images or bool(request.preview_steps)  # previews decode as the images do
    if decodes:
        piece_pixels = vae.piece_frames(shape.frames) * frame_pixels
        decode_bytes = (
            math.ceil(piece_pixels * vae.piece_bytes)
            + piece_pixels * FRAME_BYTES_PER_PIXEL
            + adapter.decode_attention_bytes(shape)
        )
        # What a decode keeps between pieces (a few frames of each causal convolution's input).
        decode_state = math.ceil(piece_pixels * vae.kept_bytes)
        decode_bytes = max(decode_bytes, sound_piece(adapter, vae, shape, piece_pixels))
        if values := adapter.audio_values(shape):
            wav = WAV_HEADER_BYTES + 2 * values  # 16-bit PCM
    debug = sum(d != rollout_pb2.DEBUG_TENSOR_SD for d in request.debug_tensors)
    step_event = latent * (dtypes.LATENT[request.latent_dtype].itemsize + 4 * debug)
    started_event = latent * dtypes.LATENT[request.latent_dtype].itemsize + env
    png = 3 * frame_pixels if decodes else 0  # an RGB image that does not compress
    event = max(step_event, started_event, png, wav)
    held = (
        latent * 4 * (SAMPLER_TENSORS + branches) + EVENT_COPIES * event + backlog_bytes + env + decode_state
    )
    if request.preview_steps:
        # A preview step's x0_hat (float32), and its previews, which one round sends every row of at
        # once, in the outbox beside the backlog (the rollout parks until its client reads them).
        held += latent * 4 + samples * (shape.frames * png + wav)
    # Each prompt's conditioning image is encoded on its own, a piece of work (0 without images).
    encode_bytes = vae.encode(shape)
    return RolloutMemory(
        held, row_bytes, samples * branches, decode_bytes, sizes.latent_elements, encode_bytes
    )


def refusal(
    memory: RolloutMemory, budget: MemoryBudget, request: rollout_pb2.RolloutRequest, video: bool
) -> list[tuple[str, str]]:
    """The BadRequest violations of a rollout that cannot fit the budget even alone (empty if it
    fits): each field that makes it large, with what it costs."""
    peak = budget.peak([memory])
    if peak <= budget.limit:
        return []
    over = (
        f"the rollout's estimated peak memory, {format_bytes(peak)}, is above the server's memory "
        f"budget of {format_bytes(budget.limit)} (--memory-budget)"
    )
    samples = widest(request)
    holds = "its 1 sample holds" if samples == 1 else f"its {samples} samples hold"
    rows = budget.forward_rows(memory, memory.rows)
    size = f"{request.height} x {request.width} pixels" + (f" x {request.num_frames} frames" if video else "")
    encode = f", an image's encode {format_bytes(memory.encode_bytes)}" if memory.encode_bytes else ""
    sized = (
        f"at {size} a forward of up to {rows} rows needs {format_bytes(rows * memory.row_bytes)}"
        f"{encode} and a decode piece {format_bytes(memory.decode_bytes)}; {over}"
    )
    count_field = "samples_per_prompt" if request.samples_per_prompt > 1 else "prompts"
    violations = [(count_field, f"{holds} {format_bytes(memory.held)}; {over}")]
    violations += [("height", sized), ("width", sized)]
    if video:
        violations.append(("num_frames", sized))
    return violations
