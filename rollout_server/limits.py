"""Server limits: every request dimension is bounded, and GetServerInfo reports the bounds."""

import re
from dataclasses import dataclass

from rollout.v1 import rollout_pb2
from rollout_core.transport import MAX_RECEIVE_BYTES

# Just below 4 MiB, so grpcurl and default gRPC clients (4 MiB receive limit) work unchanged.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024 - 64 * 1024
# gRPC's default receive limit: every request without images that the default limits admit fits in it
# (the largest, 65 prompts of 4096 four-byte characters, takes about 1 MiB).
_REQUEST_BYTES = 4 * 1024 * 1024
# gRPC takes its message limits as 32-bit signed integers.
_GRPC_MAX_BYTES = 2**31 - 1
# Policy versions (an update's, a request's minimum) stay below 2^63: a version at the top of the
# uint64 range would leave no room for the next update.
MAX_POLICY_VERSION = 2**63 - 1
# Room in a started event for everything but its prompts and tensor bytes (schedule, layout, env
# JSON, framing).
_STARTED_EVENT_ALLOWANCE = 64 * 1024
# Bytes a tree node may take in a started event, at most.
_TREE_NODE_BYTES = 48
# Bytes a prompt character may take in UTF-8.
_UTF8_MAX_BYTES = 4
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt]i?)?b?", re.IGNORECASE)


# The HTTP front end's largest answer (the whole rollout in one msgpack body, built in memory).
DEFAULT_MAX_HTTP_RESPONSE_BYTES = 1024**3
# Seconds an HTTP request, headers and body, may take to arrive (the largest body a server takes,
# about 68 MiB, at 2.3 MB/s and more).
DEFAULT_HTTP_READ_SECONDS = 30.0


def parse_bytes(text: str) -> int:
    """A size in bytes: ``12GiB``, ``512MiB``, ``1.5G``, ``2000000000`` (k, M, G, T: powers of 1000;
    Ki, Mi, Gi, Ti: of 1024). ValueError otherwise."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 12GiB, 512MiB, 2000000000)")
    return int(float(match["number"]) * _SIZE_UNITS[(match["unit"] or "").lower()])


@dataclass(frozen=True)
class Limits:
    max_samples: int = 64
    max_batch_size: int = 8
    max_steps: int = 100
    max_side: int = 2048
    max_prompt_chars: int = 4096
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # A trainer's iteration may send tens of small requests at once. A queued request holds only its
    # request (received, parsed and resolved: at most about 4 MiB for the largest one these limits
    # admit, its conditioning images' files left out) and those images' pixels (max_queued_image_bytes
    # for all together), so the queue holds at most about 2 GiB, and a few MiB for typical requests.
    max_queued_requests: int = 256
    max_running_samples: int = 64
    max_waiting_requests: int = 64
    max_request_id_chars: int = 128
    # One sample's latent: 8M elements (32 MiB in float32) fits 81 frames of 1280 x 720 in Wan's
    # 16-channel latent, and any image at max_side.
    max_latent_elements: int = 8 * 1024 * 1024
    stall_seconds: float = 60.0
    # A rollout held at one of its prune points waits this long at most for its caller's prune: time
    # for a trainer to decode and score the step's nodes. It sits out rounds meanwhile, as a parked
    # rollout does, so it delays itself alone (at most once per prune point).
    prune_hold_seconds: float = 10.0
    # Bytes the running rollouts may take above the loaded model (see memory.py); None: a share of
    # what the device has left once the model is loaded.
    memory_budget: int | None = None
    # Nodes of one tree rollout (its widest point is bounded by max_running_samples).
    max_tree_nodes: int = 1024
    # A conditioning image file, and its pixels as its header states them: checked before decoding,
    # so a small file that claims a huge image (a decompression bomb) costs nothing. 4 Mi pixels
    # (2048 x 2048: an image is resized to the generated size, at most max_side a side) decode to
    # 12 MiB of RGB, one image at a time, in tens of milliseconds.
    max_image_bytes: int = 4 * 1024 * 1024
    max_image_pixels: int = 4 * 1024 * 1024
    # Decode work grows with a JPEG's scans too: libjpeg decodes each scan of a progressive JPEG over
    # the whole image, some 5 ms at 2048 x 2048 on a 2-core CPU however small the scan. Its own
    # progressive mode writes 10 scans for a colour image (6 for grayscale).
    max_image_scans: int = 32
    # Conditioning images in one request (one per prompt): 16 files of max_image_bytes fit in the
    # receive limit (see max_request_bytes); 16 prompts of 4 samples fill max_samples.
    max_condition_images: int = 16
    # An image is decoded once, at admission; its RGB pixels at the request's size wait with its
    # request. Queued requests hold at most this much of them, and requests waiting for a policy
    # version as much again; beyond it a request is refused with RESOURCE_EXHAUSTED, as from a full
    # queue. 1 GiB: five requests of 16 images at 2048 x 2048, or 1365 single images at 512 x 512.
    max_queued_image_bytes: int = 1024**3

    def rows_per_forward(self, row_elements: int) -> int:
        """The most rows of one latent shape that one forward takes: ``max_batch_size``, fewer where rows
        of ``row_elements`` latent elements each would pass ``max_latent_elements`` (one at least)."""
        return min(self.max_batch_size, max(1, self.max_latent_elements // row_elements))

    def max_request_bytes(self, takes_images: bool) -> int:
        """The largest request the server receives, its gRPC receive limit (gRPC refuses a larger one
        with RESOURCE_EXHAUSTED before it is read): room for the prompts these limits admit (as a
        started event echoes them, at least gRPC's default 4 MiB), and for an image-conditioned model
        ``max_condition_images`` files of ``max_image_bytes`` besides."""
        rest = max(_REQUEST_BYTES, self.min_message_bytes)
        return rest + (self.max_condition_images * self.max_image_bytes if takes_images else 0)

    @property
    def min_message_bytes(self) -> int:
        """The smallest message limit that fits a started event of the largest request: its resolved
        request echoes every prompt and the negative prompt, and lists a tree's nodes (payloads are
        chunked, this is not)."""
        prompt_bytes = (self.max_samples + 1) * self.max_prompt_chars * _UTF8_MAX_BYTES
        return prompt_bytes + self.max_tree_nodes * _TREE_NODE_BYTES + _STARTED_EVENT_ALLOWANCE

    def check(self) -> None:
        """ValueError naming the option whose value leaves a server that cannot work."""
        if not self.min_message_bytes <= self.max_message_bytes <= MAX_RECEIVE_BYTES:
            raise ValueError(
                f"--max-message-bytes must be in [{self.min_message_bytes}, {MAX_RECEIVE_BYTES}], got "
                f"{self.max_message_bytes}: a started event of {self.max_samples} prompts of "
                f"{self.max_prompt_chars} characters must fit, and clients receive at most the upper bound"
            )
        for option, value in (
            ("--max-samples", self.max_samples),
            ("--max-batch-size", self.max_batch_size),
            ("--max-queued", self.max_queued_requests),
            ("--max-running-samples", self.max_running_samples),
            ("--max-latent-elements", self.max_latent_elements),
            ("--max-waiting", self.max_waiting_requests),
            ("--stall-seconds", self.stall_seconds),
            ("--prune-hold-seconds", self.prune_hold_seconds),
            ("--max-tree-nodes", self.max_tree_nodes),
            ("max_image_bytes", self.max_image_bytes),
            ("max_image_pixels", self.max_image_pixels),
            ("max_image_scans", self.max_image_scans),
            ("max_condition_images", self.max_condition_images),
        ):
            if not value > 0:
                raise ValueError(f"{option} must be positive, got {value}")
        if self.max_request_bytes(takes_images=True) > _GRPC_MAX_BYTES:
            raise ValueError(
                f"max_condition_images x max_image_bytes must stay below {_GRPC_MAX_BYTES} bytes with the "
                "rest of a request: gRPC's receive limit"
            )
        largest = self.max_condition_images * self.max_side**2 * 3
        if self.max_queued_image_bytes < largest:
            raise ValueError(
                f"max_queued_image_bytes must be at least {largest}: the pixels of "
                f"{self.max_condition_images} images at {self.max_side} x {self.max_side}, one request's"
            )
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"--memory-budget must be positive, got {self.memory_budget}")

    def to_proto(
        self, side_multiple: int, min_side: int, max_frames: int, frame_step: int
    ) -> rollout_pb2.Limits:
        from rollout_core import steps  # loads torch, which the command line does without

        return rollout_pb2.Limits(
            max_samples=self.max_samples,
            max_batch_size=self.max_batch_size,
            max_steps=self.max_steps,
            max_side=self.max_side,
            side_multiple=side_multiple,
            min_side=min_side,
            max_frames=max_frames,
            frame_step=frame_step,
            max_latent_elements=self.max_latent_elements,
            max_prompt_chars=self.max_prompt_chars,
            max_message_bytes=self.max_message_bytes,
            max_queued_requests=self.max_queued_requests,
            max_running_samples=self.max_running_samples,
            max_noise_level=max(sampler.max_noise_level for sampler in steps.SAMPLERS.values()),
            max_noise_levels={name: sampler.max_noise_level for name, sampler in steps.SAMPLERS.items()},
            max_waiting_requests=self.max_waiting_requests,
            stall_seconds=self.stall_seconds,
            prune_hold_seconds=self.prune_hold_seconds,
            max_tree_nodes=self.max_tree_nodes,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_image_scans=self.max_image_scans,
            max_condition_images=self.max_condition_images,
            max_queued_image_bytes=self.max_queued_image_bytes,
        )
