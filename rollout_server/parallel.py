"""Sequence parallelism: every torch.distributed concern of the server, in one place.

N ranks run the same engine rounds. Rank 0 owns the gRPC front end and the scheduler; before each
batched step it broadcasts the round (which rollouts drop, join with their resolved requests, and
step), so every rank runs the same forwards. The transformer is split with diffusers' own context
parallelism (Ulysses attention on CPU; ring or Ulysses + ring on GPUs); latents stay full and
replicated, the fp32 step runs on the gathered velocity, and noise and log-probs are computed on
every rank from the full noise tensor: no collective touches them. While idle, rank 0 broadcasts a
heartbeat, so a rank that dies or hangs is noticed within the collective timeout instead of hanging
the others.

Launch: ``rollout-server serve --sp N`` starts N - 1 helper processes itself; under ``torchrun``
(single or multi node) the launcher's RANK / WORLD_SIZE / LOCAL_RANK are used and rank 0 of the job
serves gRPC.
"""

import datetime
import functools
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig

from rollout_server.validation import InvalidRequest

log = logging.getLogger("rollout_server.parallel")

# Transformer inputs that carry the image tokens (the context-parallel output gathers them back).
IMAGE_INPUTS = ("hidden_states", "img_ids")
# Commands rank 0 broadcasts to the others.
HEARTBEAT, ROUND, UPDATE, STOP = "heartbeat", "round", "update", "stop"
# How long a failed collective waits for a spawned rank's process to exit, so the error can name it.
_EXIT_WAIT_SECONDS = 2.0


class RankFailure(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or fell out of step."""


@dataclass
class SequenceParallel:
    """This process's place in the sequence-parallel group (a group of one without --sp)."""

    degree: int = 1
    rank: int = 0
    local_rank: int = 0
    attention_split: str = "none"
    timeout_seconds: float = 120.0
    helpers: list[subprocess.Popen] = field(default_factory=list)  # ranks this process spawned
    # Coordination (commands, flags) runs on a gloo group: on the CPU even when the model uses NCCL.
    cpu_group: Any = None

    @property
    def enabled(self) -> bool:
        return self.degree > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def device(self, requested: str) -> torch.device:
        """One accelerator per rank: ``cuda`` becomes ``cuda:<local rank>``."""
        device = torch.device(requested)
        if self.enabled and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def split_transformer(self, transformer: torch.nn.Module) -> None:
        """Apply diffusers' context parallelism to the transformer, or refuse with a clear message."""
        if not self.enabled:
            return
        name = type(transformer).__name__
        if getattr(transformer, "_cp_plan", None) is None:
            raise SystemExit(
                f"{name} has no context-parallel plan in diffusers: --sp {self.degree} is not supported"
            )
        ulysses, ring = {
            "ulysses": (self.degree, 1),
            "ring": (1, self.degree),
            "ulysses+ring": (2, self.degree // 2),
        }[self.attention_split]
        if ulysses * ring != self.degree:
            raise SystemExit(f"--attention-split ulysses+ring needs an even --sp, got {self.degree}")
        heads = transformer.config.num_attention_heads
        if heads % ulysses:
            raise SystemExit(
                f"{name} has {heads} attention heads: not divisible by the Ulysses degree {ulysses}"
            )
        # Ulysses alone may split uneven lengths (prompts of any token count); ring attention may not.
        config = ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring, ulysses_anything=ring == 1)
        transformer.enable_parallelism(config=config)

    def check_splittable(self, transformer: torch.nn.Module, latent_shape, envs) -> None:
        """Every sequence the transformer's context-parallel plan splits must divide by the degree
        (with Ulysses alone, only the image tokens, which are gathered back at the output);
        InvalidRequest names the request field that sets the offending length otherwise."""
        if not self.enabled:
            return
        uneven_text = self.attention_split == "ulysses"
        inputs = {"hidden_states": (1, *latent_shape)}
        for per_prompt in envs.values():
            for env in per_prompt:
                inputs.update({k: tuple(v.shape) for k, v in env.items() if isinstance(v, torch.Tensor)})
        for plan in transformer._cp_plan.values():
            if not isinstance(plan, dict):
                continue
            for name, split in plan.items():
                image = name in IMAGE_INPUTS
                if name not in inputs or not hasattr(split, "split_dim") or (uneven_text and not image):
                    continue
                length = inputs[name][split.split_dim]
                if length % self.degree:
                    reason = (
                        f"{name} has {length} tokens, which do not split evenly across {self.degree} ranks"
                    )
                    raise InvalidRequest([("height" if image else "prompts", reason)])

    def _collective(self, what: str, action):
        try:
            return action()
        except Exception as error:  # gloo/NCCL raise RuntimeError and friends
            raise RankFailure(f"{what} failed: {self.describe_failure()}{error}") from error

    def broadcast_command(self, command: str, payload: bytes = b"") -> tuple[str, bytes]:
        """Rank 0 sends (command, payload); the others receive it. The payload (a round, or a whole
        weight update) travels as one uint8 tensor on the CPU group, not pickled, never on a GPU."""
        if not self.enabled:
            return command, payload
        header = [(command, len(payload))]
        self._collective(
            f"broadcast of {command!r}", lambda: dist.broadcast_object_list(header, 0, self.cpu_group)
        )
        command, size = header[0]
        if not size:
            return command, b""
        if self.is_leader:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(size, dtype=torch.uint8)
        self._collective(f"{command!r} payload", lambda: dist.broadcast(data, 0, group=self.cpu_group))
        return command, payload if self.is_leader else data.numpy().tobytes()

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """Rank 0's contiguous CPU ``tensor`` into the same-shaped ``tensor`` of the other ranks, in
        place, as its bytes (any dtype) on the CPU group."""
        if not self.enabled or not tensor.numel():
            return
        data = tensor.view(-1).view(torch.uint8)
        self._collective("tensor broadcast", lambda: dist.broadcast(data, 0, group=self.cpu_group))

    def all_succeeded(self, ok: bool) -> bool:
        """Whether every rank reports success (an all-reduce of the flags)."""
        if not self.enabled:
            return ok
        value = torch.tensor([int(ok)], dtype=torch.int32)
        reduce = functools.partial(dist.all_reduce, value, op=dist.ReduceOp.MIN, group=self.cpu_group)
        self._collective("success check", reduce)
        return bool(value.item())

    def leader_decides(self, flag: bool) -> bool:
        """Rank 0's ``flag``, on every rank (a decision only rank 0 can take, which all must follow)."""
        if not self.enabled:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32)
        self._collective("decision", lambda: dist.broadcast(value, 0, group=self.cpu_group))
        return bool(value.item())

    def describe_failure(self) -> str:
        """Which ranks are gone, when this process started them. A collective fails as soon as a dead
        rank's sockets close, which can be before its process has exited: wait up to
        ``_EXIT_WAIT_SECONDS`` for one to be reaped."""
        deadline = time.monotonic() + _EXIT_WAIT_SECONDS
        while True:
            dead = [
                (rank, p.returncode) for rank, p in enumerate(self.helpers, start=1) if p.poll() is not None
            ]
            if dead or not self.helpers or time.monotonic() > deadline:
                return "".join(f"rank {rank} exited with {code}; " for rank, code in dead)
            time.sleep(0.01)

    def shutdown(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()
        for helper in self.helpers:
            try:
                helper.wait(timeout=self.timeout_seconds)
            except subprocess.TimeoutExpired:
                helper.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(degree: int, attention_split: str, timeout_seconds: float, device: str) -> SequenceParallel:
    """Join (under torchrun) or form (``--sp N``: spawn ranks 1..N-1) the process group."""
    launched = "WORLD_SIZE" in os.environ
    if not launched and degree == 1:
        return SequenceParallel()
    helpers = []
    if not launched:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(degree))
        os.environ.update(RANK="0", LOCAL_RANK="0")
        for rank in range(1, degree):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            helpers.append(subprocess.Popen([sys.executable, "-m", "rollout_server", *sys.argv[1:]], env=env))
    world_size = int(os.environ["WORLD_SIZE"])
    if launched and degree not in (1, world_size):
        raise SystemExit(f"--sp {degree} disagrees with the launcher's WORLD_SIZE={world_size}")
    group = SequenceParallel(
        degree=world_size,
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        attention_split=attention_split if world_size > 1 else "none",
        timeout_seconds=timeout_seconds,
        helpers=helpers,
    )
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "gloo" and group.attention_split not in ("none", "ulysses"):
        raise SystemExit(
            "ring attention needs GPUs (no CPU log-sum-exp kernel): use --attention-split ulysses"
        )
    if backend == "nccl":
        torch.cuda.set_device(group.local_rank)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    dist.init_process_group(backend, timeout=timeout)
    group.cpu_group = (
        dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    )
    log.info("rank %d of %d ready (pid %d, %s)", group.rank, world_size, os.getpid(), backend)
    return group
