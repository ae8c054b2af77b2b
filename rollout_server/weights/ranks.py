"""Rank 0's checked update sent to the other sequence-parallel ranks.

One broadcast command carries the header and the manifest (each tensor's name, dtype and shape); then
each tensor is broadcast as its own bytes, from the tensor rank 0 holds into a fresh tensor of that
shape on every other rank. No rank holds more than the update's own tensors: no serialised copy of the
update exists anywhere.
"""

import json
import struct
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_core import dtypes
from rollout_server.parallel.protocol import UPDATE
from rollout_server.weights.update import WeightUpdate, from_header, header_of

if TYPE_CHECKING:
    from rollout_server.parallel import SequenceParallel


def send(parallel: "SequenceParallel", update: WeightUpdate) -> None:
    """Rank 0: send ``update`` to the other ranks (they run ``receive`` on the command's payload)."""
    header = header_of(update).SerializeToString()
    manifest = [[name, dtypes.NAMES[t.dtype], list(t.shape)] for name, t in update.tensors.items()]
    payload = struct.pack("<Q", len(header)) + header + json.dumps(manifest).encode()
    parallel.broadcast_command(UPDATE, payload)
    for tensor in update.tensors.values():
        parallel.broadcast_tensor(tensor.contiguous())


def receive(parallel: "SequenceParallel", payload: bytes) -> WeightUpdate:
    """Another rank: the update whose header and manifest rank 0 broadcast, its tensors received in
    the manifest's order (rank 0 checked their values)."""
    (size,) = struct.unpack("<Q", payload[:8])
    header = rollout_pb2.WeightsUpdateHeader.FromString(payload[8 : 8 + size])
    tensors = {}
    for name, dtype, shape in json.loads(payload[8 + size :]):
        tensors[name] = torch.empty(shape, dtype=dtypes.BY_NAME[dtype])
        parallel.broadcast_tensor(tensors[name])
    return from_header(header, tensors, sum(t.nbytes for t in tensors.values()))
