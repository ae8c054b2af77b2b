"""UpdateWeights: an update's stream of messages turned into tensors as its bytes arrive.

The JSON header at the front of the buffer is parsed and checked first (dtypes, shapes, offsets that
tile the data exactly); each tensor then gets its own buffer, allocated uninitialised when its first
byte arrives and filled straight from the received pieces. So memory grows with the bytes received,
never with the sizes a client declares, every tensor owns its memory (the engine may adopt it as a
parameter), and each one is checked as soon as it is complete, while later bytes are still arriving.

The UpdateWeights messages themselves are read by ``parse_update_message``, which views each piece
inside the received bytes instead of copying it out of a protobuf message.
"""

import asyncio
import json
import math
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from rollout.v1 import rollout_pb2
from rollout_core.dtypes import BY_SAFETENSORS
from rollout_server.errors import UploadIdle
from rollout_server.quoting import quoted
from rollout_server.weights.spec import HEADER_ALLOWANCE_BYTES, check_finite, check_version
from rollout_server.weights.update import WeightUpdate, from_header, reject

MAX_DIMS = 8
MAX_DIM = 2**40
# The wire tag of UpdateWeightsRequest.data (field 2, length-delimited).
_DATA_TAG = 0x12


@dataclass(frozen=True)
class UpdateMessage:
    """One UpdateWeightsRequest: its header (the first message's) and its piece of the buffer."""

    header: rollout_pb2.WeightsUpdateHeader | None
    data: memoryview


def _varint(raw: bytes, position: int) -> tuple[int, int]:
    """(value, position after it) of the protobuf varint at ``position``; value -1 if malformed."""
    value = shift = 0
    while position < len(raw) and shift < 64:
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    return -1, position


def parse_update_message(raw: bytes) -> UpdateMessage | None:
    """``raw`` as an UpdateWeightsRequest, or None if it is not one (the handler answers
    INVALID_ARGUMENT). Every message after the first holds its ``data`` field alone: that piece is then
    a view on ``raw``, where protobuf would copy it twice (into the message and out of it), a model's
    worth of copies per update. Any other shape goes through protobuf."""
    if raw[:1] == bytes([_DATA_TAG]):
        length, start = _varint(raw, 1)
        if start + length == len(raw):
            return UpdateMessage(None, memoryview(raw)[start:])
    try:
        message = rollout_pb2.UpdateWeightsRequest.FromString(raw)
    except DecodeError:
        return None
    return UpdateMessage(message.header if message.HasField("header") else None, memoryview(message.data))


class MalformedBuffer(ValueError):
    """The bytes are not a safetensors buffer this server reads."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _entry(name: str, info: object, begin_expected: int) -> tuple[Entry, int]:
    """The checked header entry of one tensor and where its data ends."""
    what = f"tensor {quoted(name)}"
    if not isinstance(info, dict) or info.get("dtype") not in BY_SAFETENSORS:
        raise MalformedBuffer(f"{what}: dtype must be one of {sorted(BY_SAFETENSORS)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(type(n) is int and 0 <= n <= MAX_DIM for n in shape)
    ):
        raise MalformedBuffer(f"{what}: shape must be at most {MAX_DIMS} integers in [0, 2^40]")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
        raise MalformedBuffer(f"{what}: data_offsets must be two integers")
    dtype = BY_SAFETENSORS[info["dtype"]]
    nbytes = math.prod(shape) * dtype.itemsize
    begin, end = offsets
    if begin != begin_expected or end - begin != nbytes:
        raise MalformedBuffer(
            f"{what}: data_offsets {offsets} do not follow the previous tensor's data at "
            f"{begin_expected} with the {nbytes} bytes of its shape and dtype"
        )
    return Entry(name, dtype, tuple(shape), nbytes), end


def _data_order(item: tuple[str, object]) -> tuple:
    """A header entry's data offsets, to sort by (an empty tensor before the one starting where it
    does); (-1,) if they are malformed, which _entry then refuses."""
    offsets = item[1].get("data_offsets") if isinstance(item[1], dict) else None
    if isinstance(offsets, list) and all(type(n) is int for n in offsets):
        return tuple(offsets)
    return (-1,)


def parse_header(text: bytes, data_bytes: int) -> list[Entry]:
    """The tensors a safetensors JSON header describes, in data order; MalformedBuffer unless their
    data exactly fills ``data_bytes``."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise MalformedBuffer(f"the header is not JSON: {quoted(str(error))}") from error
    if not isinstance(header, dict):
        raise MalformedBuffer("the header is not a JSON object")
    header.pop("__metadata__", None)
    return layout_entries(header, data_bytes)


def layout_entries(header: dict[str, object], data_bytes: int) -> list[Entry]:
    """The tensors of a safetensors header's entries (name: dtype, shape, data_offsets), in data order;
    MalformedBuffer unless their data exactly fills ``data_bytes``."""
    entries, end = [], 0
    for name, info in sorted(header.items(), key=_data_order):
        entry, end = _entry(name, info, end)
        entries.append(entry)
    if end != data_bytes:
        raise MalformedBuffer(
            f"the tensors' data is {end} bytes; the buffer holds {data_bytes} bytes of data"
        )
    return entries


class TensorAssembler:
    """Builds the tensors of a safetensors buffer of ``total_bytes`` from consecutive pieces of it.
    ``on_tensor(name, tensor)`` runs on each tensor once complete (and may raise to refuse it)."""

    def __init__(
        self, total_bytes: int, max_header_bytes: int, on_tensor: Callable[[str, torch.Tensor], None]
    ):
        self.total_bytes = total_bytes
        self.max_header_bytes = max_header_bytes
        self.on_tensor = on_tensor
        self.received = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self._prefix = bytearray()  # the length and JSON header, until parsed
        self._entries: list[Entry] | None = None
        self._next = 0  # index of the entry being filled
        self._raw: torch.Tensor | None = None  # its bytes
        self._raw_view = memoryview(b"")
        self._filled = 0

    @classmethod
    def of_layout(
        cls, entries: list[Entry], on_tensor: Callable[[str, torch.Tensor], None]
    ) -> "TensorAssembler":
        """An assembler of data laid out as ``entries`` say (from ``layout_entries``), with no header
        in front of it."""
        assembler = cls(sum(entry.nbytes for entry in entries), 0, on_tensor)
        assembler._entries = entries
        return assembler

    def feed(self, data: bytes | memoryview) -> None:
        if self.received + len(data) > self.total_bytes:
            raise MalformedBuffer(f"more bytes than header.total_bytes = {self.total_bytes}")
        self.received += len(data)
        view = memoryview(data)
        if self._entries is None:
            view = self._read_header(view)
            if self._entries is None:
                return
        while True:
            self._complete_empty_tensors()
            if not view:
                return
            if self._raw is None:
                entry = self._entries[self._next]
                self._raw = torch.empty(entry.nbytes, dtype=torch.uint8)
                self._raw_view, self._filled = memoryview(self._raw.numpy()), 0
            taken = min(len(view), len(self._raw_view) - self._filled)
            self._raw_view[self._filled : self._filled + taken] = view[:taken]
            self._filled += taken
            view = view[taken:]
            if self._filled == len(self._raw_view):
                self._finish_tensor()

    def result(self) -> dict[str, torch.Tensor]:
        """Every tensor; MalformedBuffer if the buffer was not complete."""
        if self.received < self.total_bytes:
            raise MalformedBuffer(
                f"truncated: the stream ended after {self.received} of {self.total_bytes} bytes"
            )
        if self._entries is None:
            raise MalformedBuffer(f"the {self.received} bytes received do not hold a safetensors header")
        return self.tensors

    def _read_header(self, view: memoryview) -> memoryview:
        """Collect the header from ``view``; parse it once complete. Returns the bytes after it."""
        needed = 8 if len(self._prefix) < 8 else 8 + self._header_size()
        taken = min(len(view), needed - len(self._prefix))
        self._prefix += view[:taken]
        view = view[taken:]
        if len(self._prefix) == 8:
            size = self._header_size()
            if not 2 <= size <= min(self.max_header_bytes, self.total_bytes - 8):
                raise MalformedBuffer(
                    f"header length {size} is not in [2, {min(self.max_header_bytes, self.total_bytes - 8)}]"
                )
            return self._read_header(view) if view else view
        if len(self._prefix) == needed:
            self._entries = parse_header(bytes(self._prefix[8:]), self.total_bytes - needed)
            self._prefix = bytearray()
        return view

    def _header_size(self) -> int:
        return struct.unpack("<Q", self._prefix[:8])[0]

    def _complete_empty_tensors(self) -> None:
        while self._raw is None and self._next < len(self._entries) and not self._entries[self._next].nbytes:
            self._raw = torch.empty(0, dtype=torch.uint8)
            self._finish_tensor()

    def _finish_tensor(self) -> None:
        entry = self._entries[self._next]
        tensor = self._raw.view(entry.dtype).reshape(entry.shape)
        self._raw, self._raw_view, self._next = None, memoryview(b""), self._next + 1
        self.on_tensor(entry.name, tensor)
        self.tensors[entry.name] = tensor


async def receive(
    requests: AsyncIterator[UpdateMessage],
    current_version: Callable[[], int],
    max_bytes: int,
    idle_seconds: float,
) -> WeightUpdate:
    """Reassemble an UpdateWeights stream into one update, each tensor built and checked for finite
    values as its bytes arrive. A stale version is refused before any data is read; a stream silent for
    ``idle_seconds`` ends with UploadIdle."""
    header, assembler = None, None
    loop = asyncio.get_running_loop()
    try:
        # One deadline, moved on at every message (no timer task per message).
        async with asyncio.timeout(idle_seconds) as idle:
            async for message in requests:
                idle.reschedule(loop.time() + idle_seconds)
                if header is None:
                    header = _first_header(message, current_version(), max_bytes)
                    assembler = TensorAssembler(header.total_bytes, HEADER_ALLOWANCE_BYTES, check_finite)
                elif message.header is not None:
                    raise reject("header", "only the first message carries a header")
                try:
                    assembler.feed(message.data)
                except MalformedBuffer as error:
                    raise reject("data", str(error)) from error
    except TimeoutError as error:
        raise UploadIdle(f"no update message for {idle_seconds:g} s: the upload was dropped") from error
    if header is None:
        raise reject("header", "the stream was empty")
    try:
        tensors = assembler.result()
    except MalformedBuffer as error:
        raise reject("data", str(error)) from error
    return from_header(header, tensors, header.total_bytes)


def _first_header(
    message: UpdateMessage, current_version: int, max_bytes: int
) -> rollout_pb2.WeightsUpdateHeader:
    """The checked header of an update stream's first message."""
    if message.header is None:
        raise reject("header", "the first message must carry the header")
    header = message.header
    check_version(header.policy_version, current_version, "header.policy_version")
    if not 0 < header.total_bytes <= max_bytes:
        raise reject("header.total_bytes", f"must be in [1, {max_bytes}], got {header.total_bytes}")
    return header
