"""Tensors on the wire: one safetensors buffer per event, a readable manifest, and chunking.

An event's tensors are serialised with ``safetensors.torch.save`` into one buffer. The manifest lists
every tensor (name, dtype, shape, byte size) in buffer order, so grpcurl and humans can read what a
message holds without decoding it. A buffer larger than a message allows is cut into pieces: the
first travels in the event itself, the rest in the ``chunk`` messages that follow it.
"""

import json
import struct
from collections.abc import Mapping

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from rollout.v1 import rollout_pb2


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


def manifest_of(buffer: bytes) -> list[rollout_pb2.TensorInfo]:
    """The manifest of a safetensors buffer, read from its JSON header, in data order."""
    (header_size,) = struct.unpack("<Q", buffer[:8])
    header = json.loads(buffer[8 : 8 + header_size])
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
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


def split(data: bytes, first_size: int, chunk_size: int) -> tuple[bytes, list[bytes]]:
    """Cut ``data`` into a first piece of at most ``first_size`` bytes and pieces of ``chunk_size``."""
    first, rest = data[:first_size], memoryview(data)[first_size:]
    return first, [bytes(rest[start : start + chunk_size]) for start in range(0, len(rest), chunk_size)]
