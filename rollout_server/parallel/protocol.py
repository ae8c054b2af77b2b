"""What rank 0 sends the other ranks: a command before each round, update or change of state, and
the payloads some of them carry.

N ranks run the same engine rounds. Rank 0 owns the front ends and the scheduler; before each
batched step it broadcasts the round (which rollouts drop, join with their resolved requests, are
pruned, and step: ``encode_round``), so every rank runs the same forwards. Latents stay full and
replicated, the fp32 step runs on the gathered velocity, and noise and log-probs are computed on
every rank from the full noise tensor: no collective touches them. While idle, rank 0 broadcasts a
heartbeat, so a rank that dies or hangs is noticed within the collective timeout instead of hanging
the others. The commands travel by ``SequenceParallel.broadcast_command``, in rank 0's order.
"""

import json
from typing import TYPE_CHECKING

from rollout.v1 import rollout_pb2
from rollout_server.images import ConditionImage

if TYPE_CHECKING:
    from rollout_server.scheduler import Round

HEARTBEAT, ROUND, STOP = "heartbeat", "round", "stop"
UPDATE = "update"  # a weight update rank 0 received (weights.ranks)
RELEASE, RESUME = "release", "resume"  # the weights' memory (residency.py)
# The weight-sync group's lifecycle (rollout_server.weight_sync).
SYNC_JOIN, SYNC_INSTALL, SYNC_UPDATE, SYNC_LEAVE = "sync-join", "sync-install", "sync-update", "sync-leave"
SYNC_COMMANDS = (SYNC_JOIN, SYNC_INSTALL, SYNC_UPDATE, SYNC_LEAVE)

# A rollout joining a round: its key, its resolved request and its conditioning images.
Joining = tuple[int, rollout_pb2.RolloutRequest, list[ConditionImage]]


def encode_round(planned: "Round") -> bytes:
    """A round as rank 0 broadcasts it: a JSON header, then each joining request's bytes, each
    followed by its conditioning images (their description and RGB pixels)."""
    parts, join = [], []
    for job in planned.join:
        images = [image.pack() for image in job.condition_images]
        request = job.request.SerializeToString()
        join.append([job.key, len(request), [[len(info), len(pixels)] for info, pixels in images]])
        parts += [request, *(part for image in images for part in image)]
    header = {
        "drop": planned.drop,
        "join": join,
        "prune": [[key, nodes] for key, nodes in planned.prune.items()],
        "step": planned.step,
    }
    return json.dumps(header).encode() + b"\n" + b"".join(parts)


def decode_round(payload: bytes) -> tuple[list[int], list[Joining], dict[int, list[int]], list[int]]:
    """(drop, join, prune, step) of an encoded round."""
    header_bytes, _, data = payload.partition(b"\n")
    header = json.loads(header_bytes)
    join, offset = [], 0

    def take(size: int) -> bytes:
        nonlocal offset
        offset += size
        return data[offset - size : offset]

    for key, size, image_sizes in header["join"]:
        request = rollout_pb2.RolloutRequest.FromString(take(size))
        images = [ConditionImage.unpack(take(info), take(pixels)) for info, pixels in image_sizes]
        join.append((key, request, images))
    return header["drop"], join, dict(header["prune"]), header["step"]
