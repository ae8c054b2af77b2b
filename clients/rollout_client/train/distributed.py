"""Data-parallel trainer ranks (``torchrun``): each rolls out its share, gradients are averaged."""

import os
from dataclasses import dataclass
from typing import TypeVar

import torch

from rollout.v1 import rollout_pb2
from rollout_core.layout import prompt_groups, sample_layout

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This trainer process among the data-parallel ranks of a ``torchrun`` launch (or alone): each
    rank rolls out its share of every iteration's prompt groups, and the gradients are averaged over
    the ranks before each optimizer step (the all-reduce DDP does), so every rank holds the same
    policy; rank 0 pushes it and writes the run's files."""

    rank: int = 0
    world: int = 1

    @classmethod
    def start(cls, device: str) -> "Ranks":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend)
        return cls(torch.distributed.get_rank(), world)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree(self, value: T) -> T:
        """Rank 0's ``value``, on every rank."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order."""
        if self.world == 1:
            return [value]
        values = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        return values

    def average_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        for parameter in parameters:
            if parameter.grad is not None:
                torch.distributed.all_reduce(parameter.grad)
                parameter.grad /= self.world

    def share(self, request: rollout_pb2.RolloutRequest, max_samples: int) -> rollout_pb2.RolloutRequest:
        """This rank's prompt groups of ``request`` (a contiguous block), with the seeds one server
        would give them: every rank count draws the same noise for the same sample."""
        if self.world == 1:
            return request
        layout, _ = sample_layout(request, max_samples)
        per_rank = len(request.prompts) // self.world
        mine = range(self.rank * per_rank, (self.rank + 1) * per_rank)
        share = prompt_groups(request, layout, mine)
        share.request_id = f"{request.request_id}-rank-{self.rank}"
        return share

    def close(self) -> None:
        if self.world > 1:
            torch.distributed.destroy_process_group()
