"""Server limits: every request dimension is bounded, and GetServerInfo reports the bounds.

Each limit is declared once, as a field of ``Limits`` made by ``limit(...)``: its default, its help, its
flag of ``rollout-server serve`` (where it has one), whether GetServerInfo's ``Limits`` message reports
it (under its own name) and its bound. From the fields come the command line (``add_flags``,
``of_flags``), the checks (``Limits.check``, run on construction, so code is refused as the command
line is), the message (``to_proto``) and the table of docs/protocol.md (``limits_table``). The
message's other fields (``DERIVED``) come from the model and the samplers, not from a limit.
"""

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

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


def byte_size(text: str) -> int:
    """``parse_bytes`` as a flag's type: its error is the command line's message."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# A limit's bound beyond the generic one: why ``value`` cannot work with the other ``limits``, or None.
Rule = Callable[["Limits", Any], str | None]


@dataclass(frozen=True)
class Declaration:
    """What a limit declares besides its name and default (see ``limit``)."""

    help: str
    flag: str | None
    reported: bool
    most: int | None
    rule: Rule | None
    bound: str | None
    parse: Callable[[str], Any] | None

    def option(self, name: str) -> str:
        """How a message names the limit: its flag, else its field."""
        return self.flag or name


def limit(
    default: Any,
    help: str,  # noqa: A002 - argparse's name
    *,
    flag: str | None = None,
    reported: bool = True,
    most: int | None = None,
    rule: Rule | None = None,
    bound: str | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A field of ``Limits``: ``default``; ``help`` (what it bounds, for --help and the docs);
    ``flag``, the option of ``rollout-server serve`` that sets it (None: set in code only);
    ``reported``: GetServerInfo's ``Limits`` reports it under the field's name. Its bound: above 0
    (None too, where the default is None) and at most ``most``, else the largest value of its proto
    field's type; or ``rule``, which ``bound`` describes. ``parse``: the flag's type where it is not
    the field's."""
    declaration = Declaration(help, flag, reported, most, rule, bound, parse)
    return dataclasses.field(default=default, metadata={"limit": declaration})


def _message_bytes(limits: "Limits", value: int) -> str | None:
    if limits.min_message_bytes <= value <= MAX_RECEIVE_BYTES:
        return None
    return (
        f"must be in [{limits.min_message_bytes}, {MAX_RECEIVE_BYTES}], got {value}: a started event of "
        f"{limits.max_samples} prompts of {limits.max_prompt_chars} characters must fit, and clients "
        "receive at most the upper bound"
    )


_PROTO_FIELDS = rollout_pb2.Limits.DESCRIPTOR.fields_by_name
# The largest value of each integer type of a proto field (a larger one cannot be reported).
_PROTO_MOST = {FieldDescriptor.CPPTYPE_UINT32: 2**32 - 1, FieldDescriptor.CPPTYPE_UINT64: 2**64 - 1}

# The fields of GetServerInfo's Limits that no limit sets: what sets each.
DERIVED = {
    "side_multiple": "the model: its pixel granularity",
    "min_side": "the model: `side_multiple`, or more where its decoder needs it (LTX-2: 64)",
    "max_frames": "the model: 1 for an image family",
    "frame_step": "the model: a video family's frame step (`num_frames - 1` is a multiple of it), else 0",
    "max_update_bytes": "the model: its transformers' size and room for a safetensors header",
    "max_request_bytes": "the limits and the model: 4 MiB (at least `min_message_bytes`), and "
    "`max_condition_images` files of `max_image_bytes` besides for an image-conditioned model",
    "memory_budget_bytes": "`--memory-budget`, else the engine's share of the memory left once the model "
    "is loaded",
    "max_noise_level": "the samplers: the largest of `max_noise_levels`",
    "max_noise_levels": "the samplers: each one's bound on `noise_level`",
}
# The derived fields that ``to_proto`` fills itself.
_SAMPLER_FIELDS = ("max_noise_level", "max_noise_levels")


@dataclass(frozen=True)
class Limits:
    """The server's limits. Declaration order is the command line's and the docs table's. A value that
    leaves a server unable to work raises ValueError naming its flag (else its field) on construction,
    with the command line's message."""

    max_message_bytes: int = limit(
        DEFAULT_MAX_MESSAGE_BYTES,
        "the largest message the server sends, in bytes (larger payloads are chunked); a started event "
        "of the largest request these limits admit must fit",
        flag="--max-message-bytes",
        rule=_message_bytes,
        bound=f"a started event of the largest request ((max_samples + 1) x max_prompt_chars x "
        f"{_UTF8_MAX_BYTES} bytes, {_TREE_NODE_BYTES} a tree node, and 64 KiB) to {MAX_RECEIVE_BYTES} (what "
        "clients receive)",
    )
    max_batch_size: int = limit(
        8,
        "transformer rows per forward (a sample in one CFG branch), across concurrent rollouts; "
        "1 turns batching off",
        flag="--max-batch-size",
    )
    max_samples: int = limit(64, "samples per request", flag="--max-samples")
    # A trainer's iteration may send tens of small requests at once. A queued request holds only its
    # request (received, parsed and resolved: at most about 4 MiB for the largest one these limits
    # admit, its conditioning images' files left out) and those images' pixels (max_queued_image_bytes
    # for all together), so the queue holds at most about 2 GiB, and a few MiB for typical requests.
    max_queued_requests: int = limit(256, "rollouts queued or running", flag="--max-queued")
    max_running_samples: int = limit(
        64,
        "samples of the rollouts stepping together (a larger rollout runs alone)",
        flag="--max-running-samples",
    )
    # Nodes of one tree rollout (its widest point is bounded by max_running_samples).
    max_tree_nodes: int = limit(
        1024,
        "nodes of a tree rollout (its leaves are bounded by --max-running-samples)",
        flag="--max-tree-nodes",
    )
    # One sample's latent: 8M elements (32 MiB in float32) fits 81 frames of 1280 x 720 in Wan's
    # 16-channel latent, and any image at max_side.
    max_latent_elements: int = limit(
        8 * 1024 * 1024,
        "elements of one sample's latent, whatever its frames and size",
        flag="--max-latent-elements",
    )
    max_waiting_requests: int = limit(
        64,
        "requests waiting for their min_policy_version (they hold no rollout slot)",
        flag="--max-waiting",
    )
    stall_seconds: float = limit(
        60.0,
        "end a stream (ABORTED) whose client has read nothing for this long, freeing its work; "
        "an HTTP client that takes too little of its answer for this long is dropped",
        flag="--stall-seconds",
    )
    # A rollout held at one of its prune points waits this long at most for its caller's prune: time
    # for a trainer to decode and score the step's nodes. It sits out rounds meanwhile, as a parked
    # rollout does, so it delays itself alone (at most once per prune point).
    prune_hold_seconds: float = limit(
        10.0,
        "the longest a tree rollout waits at one of its prune points for its caller's prune",
        flag="--prune-hold-seconds",
    )
    # Bytes the running rollouts may take above the loaded model (see memory.py); None: a share of
    # what the device has left once the model is loaded. GetServerInfo reports the budget in force
    # (``memory_budget_bytes``, derived).
    memory_budget: int | None = limit(
        None,
        "bytes the running rollouts may take above the loaded model, e.g. 12GiB (default: half the "
        "RAM available once the model is loaded on a CPU, 80% of the free GPU memory on CUDA). Each "
        "request's estimate counts what it holds (latents, sampler tensors, stream, env, a video "
        "decode's cache) and the largest piece of work: a forward, a decode piece or a conditioning "
        "image's encode, the VAE's measured at start-up on a probe (on a CPU with what glibc's heap "
        "keeps); a request that cannot fit alone is refused",
        flag="--memory-budget",
        reported=False,
        most=_PROTO_MOST[FieldDescriptor.CPPTYPE_UINT64],
        parse=byte_size,
    )
    max_steps: int = limit(100, "denoising steps of a rollout")
    max_side: int = limit(2048, "height and width in pixels")
    max_prompt_chars: int = limit(4096, "characters of a prompt, and of the negative prompt")
    max_request_id_chars: int = limit(128, "characters of a request id", reported=False)
    # A conditioning image file, and its pixels as its header states them: checked before decoding,
    # so a small file that claims a huge image (a decompression bomb) costs nothing. 4 Mi pixels
    # (2048 x 2048: an image is resized to the generated size, at most max_side a side) decode to
    # 12 MiB of RGB, one image at a time, in tens of milliseconds.
    max_image_bytes: int = limit(4 * 1024 * 1024, "bytes of one conditioning image file")
    max_image_pixels: int = limit(
        4 * 1024 * 1024, "pixels (width x height, as its header states) of one conditioning image"
    )
    # Decode work grows with a JPEG's scans too: libjpeg decodes each scan of a progressive JPEG over
    # the whole image, some 5 ms at 2048 x 2048 on a 2-core CPU however small the scan. Its own
    # progressive mode writes 10 scans for a colour image (6 for grayscale).
    max_image_scans: int = limit(32, "scans of a conditioning JPEG, counted before decoding")
    # Conditioning images in one request (one per prompt): 16 files of max_image_bytes fit in the
    # receive limit (see max_request_bytes); 16 prompts of 4 samples fill max_samples.
    max_condition_images: int = limit(16, "conditioning images in one request")
    # An image is decoded once, at admission; its RGB pixels at the request's size wait with its
    # request. Queued requests hold at most this much of them, and requests waiting for a policy
    # version as much again; beyond it a request is refused with RESOURCE_EXHAUSTED, as from a full
    # queue. 1 GiB: five requests of 16 images at 2048 x 2048, or 1365 single images at 512 x 512.
    max_queued_image_bytes: int = limit(
        1024**3,
        "bytes of the conditioning images' RGB pixels that queued requests hold together (as much again "
        "for requests waiting for a policy version); at least one request's, max_condition_images "
        "images at max_side x max_side",
    )

    def __post_init__(self) -> None:
        self.check()

    @classmethod
    def declared(cls) -> Iterator[tuple[dataclasses.Field, Declaration]]:
        """Each limit's field and declaration, in declaration order."""
        for field in dataclasses.fields(cls):
            yield field, field.metadata["limit"]

    @classmethod
    def most(cls, field: dataclasses.Field, declaration: Declaration) -> int | None:
        """The largest value of a limit: declared, else its proto field's type's (None: unbounded)."""
        if declaration.most is not None or not declaration.reported:
            return declaration.most
        return _PROTO_MOST.get(_PROTO_FIELDS[field.name].cpp_type)

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
        """ValueError naming the option whose value leaves a server that cannot work: each limit's own
        bound in declaration order, then the bounds that depend on other limits, then the rules
        between limits."""
        for field, declaration in sorted(self.declared(), key=lambda pair: pair[1].rule is not None):
            value = getattr(self, field.name)
            if value is None and field.default is None:
                continue
            if declaration.rule is not None:
                problem = declaration.rule(self, value)
            elif not value > 0:  # NaN too
                problem = f"must be positive, got {value}"
            elif (most := self.most(field, declaration)) is not None and value > most:
                problem = f"must be at most {most}, got {value}"
            else:
                problem = None
            if problem is not None:
                raise ValueError(f"{declaration.option(field.name)} {problem}")
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

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """The flag of each limit that has one, its help ending with its default."""
        for field, declaration in cls.declared():
            if declaration.flag is None:
                continue
            text = declaration.help.replace("%", "%%")
            if field.default is not None:
                text += f" (default: {_shown(field.default)})"
            parser.add_argument(
                declaration.flag,
                type=declaration.parse or _flag_type(field),
                default=field.default,
                dest=field.name,
                metavar=declaration.flag[2:].replace("-", "_").upper(),
                help=text,
            )

    @classmethod
    def of_flags(cls, flags: argparse.Namespace) -> "Limits":
        """The limits of parsed flags (``add_flags``'s); those without a flag keep their defaults.
        ValueError as on construction."""
        return cls(**{field.name: getattr(flags, field.name) for field, d in cls.declared() if d.flag})

    def to_proto(self, **derived: Any) -> rollout_pb2.Limits:
        """GetServerInfo's limits: each reported limit, and ``derived``, the value of each field of
        ``DERIVED`` but the samplers' bounds, which are filled here."""
        from rollout_core import steps  # loads torch, which the command line does without

        expected = set(DERIVED) - set(_SAMPLER_FIELDS)
        if set(derived) != expected:
            raise TypeError(f"to_proto takes the derived fields {sorted(expected)}, got {sorted(derived)}")
        reported = {field.name: getattr(self, field.name) for field, d in self.declared() if d.reported}
        return rollout_pb2.Limits(
            **reported,
            **derived,
            max_noise_level=max(sampler.max_noise_level for sampler in steps.SAMPLERS.values()),
            max_noise_levels={name: sampler.max_noise_level for name, sampler in steps.SAMPLERS.items()},
        )


def _flag_type(field: dataclasses.Field) -> type:
    return float if field.type is float else int


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _power_of_two(value: int) -> str:
    """``2^k - 1`` for a value one below a power of 2 (the proto types' tops), else the number."""
    k = (value + 1).bit_length() - 1
    return f"2^{k} - 1" if value > 1024 and value + 1 == 2**k else str(value)


def limits_table() -> str:
    """docs/protocol.md's table of the limits: each declared one (its flag, default, bound and
    GetServerInfo field), then the fields of GetServerInfo's Limits that the model or the samplers set."""
    rows = [
        "| limit | flag of `rollout-server serve` | default | bound | GetServerInfo `limits.` "
        "| what it bounds |",
        "|---|---|---|---|---|---|",
    ]
    for field, declaration in Limits.declared():
        if declaration.bound is not None:
            bound = declaration.bound
        else:
            most = Limits.most(field, declaration)
            if _flag_type(field) is float:
                bound = "above 0"
            else:
                bound = f"1 to {_power_of_two(most)}" if most is not None else "at least 1"
            bound += ", or unset" if field.default is None else ""
        flag = f"`{declaration.flag}`" if declaration.flag else "(in code)"
        default = "unset" if field.default is None else f"`{_shown(field.default)}`"
        proto = f"`{field.name}`" if declaration.reported else ""
        what = declaration.help.replace("|", "\\|")
        rows.append(f"| `{field.name}` | {flag} | {default} | {bound} | {proto} | {what} |")
    rows += ["", "| GetServerInfo `limits.` | set by |", "|---|---|"]
    rows += [f"| `{name}` | {source} |" for name, source in DERIVED.items()]
    return "\n".join(rows) + "\n"
