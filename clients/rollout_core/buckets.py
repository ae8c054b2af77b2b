"""How a group weight update lays its tensors out in broadcasts (rollout.v1 ``GroupTensor.bucket``).

The manifest lists the tensors in broadcast order, each with its bucket: 0 for the first, then the
previous tensor's bucket or the next one. A bucket is one uint8 broadcast: its tensors' bytes in
manifest order, each starting at a multiple of ``ALIGN`` bytes from the bucket's start (zero padding
between them), so every tensor is a view of the received buffer in its own dtype. The trainer and the
server both derive the offsets from the manifest with ``layout``, so they cannot disagree.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ALIGN = 64


@dataclass(frozen=True)
class Placed:
    """One tensor of a bucket: its index in the manifest, and where its bytes lie in the bucket."""

    index: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    nbytes: int  # padding between tensors included, none after the last
    tensors: tuple[Placed, ...]


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def layout(sizes: Sequence[int], buckets: Sequence[int]) -> list[Bucket]:
    """The buckets of tensors of ``sizes`` bytes assigned to ``buckets`` (as the manifest numbers
    them); ValueError naming the first tensor whose bucket breaks the rule."""
    placed: list[list[Placed]] = []
    for index, (nbytes, bucket) in enumerate(zip(sizes, buckets, strict=True)):
        if bucket == len(placed):
            placed.append([])
        elif bucket != len(placed) - 1:
            expected = "0" if not placed else f"{len(placed) - 1} or {len(placed)}"
            raise ValueError(f"tensors[{index}].bucket is {bucket}, must be {expected}")
        offset = aligned(placed[-1][-1].offset + placed[-1][-1].nbytes) if placed[-1] else 0
        placed[-1].append(Placed(index, offset, nbytes))
    return [Bucket(tensors[-1].offset + tensors[-1].nbytes, tuple(tensors)) for tensors in placed]


def assign(sizes: Iterable[int], bucket_bytes: int) -> list[int]:
    """The trainer's bucketing: tensors join the current bucket while it stays within
    ``bucket_bytes``; a tensor that does not fit starts the next one (a larger tensor is a bucket of
    its own)."""
    buckets: list[int] = []
    used = 0  # bytes of the current bucket
    for nbytes in sizes:
        end = aligned(used) + nbytes
        if not buckets or end > bucket_bytes:
            end = nbytes
            buckets.append(buckets[-1] + 1 if buckets else 0)
        else:
            buckets.append(buckets[-1])
        used = end
    return buckets
