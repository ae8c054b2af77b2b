"""Tensors on the wire: one safetensors buffer per event, a readable manifest, and chunking.

An event's tensors are serialised with ``safetensors.torch.save`` into one buffer. The manifest lists
every tensor (name, dtype, shape, byte size) in buffer order, so grpcurl and humans can read what a
message holds without decoding it. A buffer larger than a message allows is cut into pieces: the
first travels in the event itself, the rest in the ``chunk`` messages that follow it. Weight updates
travel the same way, client to server.
"""

import json
import struct
from collections.abc import Callable, Iterator, Mapping

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from rollout.v1 import rollout_pb2
from rollout_core import dtypes


def encode(tensors: Mapping[str, torch.Tensor]) -> tuple[list[rollout_pb2.TensorInfo], bytes]:
    """Serialise ``tensors`` (moved to the CPU, made contiguous) and describe them."""
    on_cpu, storages = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        # safetensors refuses aliases (e.g. an ODE step's x_next is its mean): give repeats their own copy.
        on_cpu[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    buffer = safetensors_save(on_cpu)
    return manifest_of(buffer), buffer


def _header(buffer: bytes | bytearray) -> tuple[int, list[tuple[str, dict]]]:
    """(offset of the data, [(name, header entry)] in data order) of a safetensors buffer."""
    (header_size,) = struct.unpack("<Q", buffer[:8])
    header = json.loads(buffer[8 : 8 + header_size])
    header.pop("__metadata__", None)
    return 8 + header_size, sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])


def manifest_of(buffer: bytes) -> list[rollout_pb2.TensorInfo]:
    """The manifest of a safetensors buffer, read from its JSON header, in data order."""
    _, entries = _header(buffer)
    return [
        rollout_pb2.TensorInfo(
            name=name,
            dtype=info["dtype"],
            shape=info["shape"],
            byte_size=info["data_offsets"][1] - info["data_offsets"][0],
        )
        for name, info in entries
    ]


def decode(buffer: bytes) -> dict[str, torch.Tensor]:
    """Tensors of a reassembled safetensors buffer (empty buffer: no tensors)."""
    return safetensors_load(buffer) if buffer else {}


def encode_in_pieces(
    tensors: Mapping[str, torch.Tensor], size: int, frame: Callable[[int, int], bytes] | None = None
) -> tuple[int, Iterator[bytes]]:
    """(length, pieces of at most ``size`` bytes) of a safetensors buffer of ``tensors``, copied
    piece by piece from the tensors' memory: a weight update is as large as the model, and holding the
    whole buffer next to it would double the trainer's memory. Tensors move to the CPU one at a time.

    ``frame(index, length)``, if given, returns bytes to put before piece ``index`` (of ``length``
    bytes) in the same copy, e.g. the fields that make it a serialised message."""
    names = list(tensors)
    header, offset = {}, 0
    for name in names:
        tensor = tensors[name]
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": dtypes.SAFETENSORS_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors pads its header to 8 bytes
    prefix = struct.pack("<Q", len(encoded)) + encoded

    def segments() -> Iterator[memoryview]:
        yield memoryview(prefix)
        for name in names:
            tensor = tensors[name].detach().cpu().contiguous()
            yield memoryview(tensor.reshape(-1).view(torch.uint8).numpy())

    def joined(index: int, parts: list[memoryview], length: int) -> bytes:
        return b"".join([frame(index, length), *parts] if frame else parts)

    def pieces_of_segments() -> Iterator[bytes]:
        parts, filled, index = [], 0, 0
        for segment in segments():
            while segment:
                part, segment = segment[: size - filled], segment[size - filled :]
                parts.append(part)
                filled += len(part)
                if filled == size:
                    yield joined(index, parts, filled)
                    parts, filled, index = [], 0, index + 1
        if parts:
            yield joined(index, parts, filled)

    return len(prefix) + offset, pieces_of_segments()


def pieces(data: bytes | memoryview, size: int) -> Iterator[bytes]:
    """``data`` in consecutive pieces of at most ``size`` bytes, each copied only when it is reached."""
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])


def split(data: bytes, first_size: int, chunk_size: int) -> tuple[bytes, list[bytes]]:
    """Cut ``data`` into a first piece of at most ``first_size`` bytes and pieces of ``chunk_size``."""
    return data[:first_size], list(pieces(memoryview(data)[first_size:], chunk_size))
