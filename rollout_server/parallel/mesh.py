"""The ranks' layout, their process group and device mesh, and this process's place among them.

A replica's ranks are laid out by a ``ParallelDims``, checked when it is made, and a device mesh built
once from it with named dims ("ring", "ulysses"), which diffusers splits the attention over. Rank 0
coordinates the others over a gloo group on the CPU (``SequenceParallel``'s collectives: what it sends
is ``protocol``'s); a collective that fails is a ``RankFailure`` naming the forked ranks that are gone.

Launch: ``rollout-server serve --sp N`` forks N - 1 helper ranks itself; under ``torchrun``
(single or multi node) the launcher's RANK / WORLD_SIZE / LOCAL_RANK are used and rank 0 of the job
serves gRPC. Nothing here knows a request field or a model family's arguments, and nothing exits the
process: problems are exceptions, which the command line turns into exit messages.
"""

import datetime
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rollout_server.errors import ParallelismUnsupported, RankFailure

log = logging.getLogger("rollout_server.parallel")

# How --sp ranks split attention: all-to-all over the heads (Ulysses), ring attention, or both.
ATTENTION_SPLITS = ("ulysses", "ring", "ulysses+ring")
# The mesh dims diffusers' ContextParallelConfig(mesh=...) looks up by name.
MESH_DIMS = ("ring", "ulysses")
# How long a failed collective waits for a forked rank's process to exit, so the error can name it.
_EXIT_WAIT_SECONDS = 2.0


@dataclass(frozen=True)
class ParallelDims:
    """How a replica's ranks divide the work, checked when made (torchtitan's ``ParallelDims``).

    Sequence parallelism over ``sp`` ranks is the one dim today: its attention splits into a Ulysses
    and a ring degree (``attention_split``). ``world_size`` counts every rank of the replica; a later
    dim (CFG branches, say) multiplies into it. ValueError names the option that is wrong."""

    sp: int = 1
    attention_split: str = "ulysses"
    world_size: int = 1

    def __post_init__(self):
        if self.sp < 1:
            raise ValueError(f"--sp must be at least 1, got {self.sp}")
        if self.attention_split not in ATTENTION_SPLITS:
            choices = ", ".join(ATTENTION_SPLITS)
            raise ValueError(f"--attention-split must be one of {choices}, got {self.attention_split!r}")
        if self.attention_split == "ulysses+ring" and self.sp % 2:
            raise ValueError(f"--attention-split ulysses+ring needs an even --sp, got {self.sp}")
        if self.world_size != self.sp:
            raise ValueError(f"--sp {self.sp} needs {self.sp} ranks, but the world has {self.world_size}")

    @property
    def ulysses(self) -> int:
        return {"ulysses": self.sp, "ring": 1, "ulysses+ring": 2}[self.attention_split]

    @property
    def ring(self) -> int:
        return self.sp // self.ulysses

    @property
    def seq_len_divisor(self) -> int:
        """Every sequence the ranks split, and gather back, is cut into this many equal parts."""
        return self.ulysses * self.ring

    @property
    def uneven_text(self) -> bool:
        """Whether sequences that are not gathered back (the text tokens) may have any length: Ulysses
        alone splits them unevenly (diffusers' ``ulysses_anything``), ring attention cannot."""
        return self.ring == 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh of the SP ranks, dims ``MESH_DIMS``: call once, on every rank."""
        return init_device_mesh(device_type, (self.ring, self.ulysses), mesh_dim_names=MESH_DIMS)


def split_inputs(transformer: torch.nn.Module) -> dict[str, int]:
    """The keyword inputs the transformer's context-parallel plan splits, each with the dim it cuts."""
    return {
        name: split.split_dim
        for plan in (getattr(transformer, "_cp_plan", None) or {}).values()
        if isinstance(plan, dict)
        for name, split in plan.items()
        if isinstance(name, str) and hasattr(split, "split_dim")
    }


def check_splittable(transformer: torch.nn.Module, dims: ParallelDims) -> None:
    """ParallelismUnsupported unless diffusers can split ``transformer`` as ``dims`` say: it needs a
    context-parallel plan (and one whose attention takes a ring split, under ring attention), and
    Ulysses splits its attention heads (query and, where grouped, key/value), so they must divide by
    its degree."""
    name = type(transformer).__name__
    if getattr(transformer, "_cp_plan", None) is None:
        raise ParallelismUnsupported(
            f"{name} has no context-parallel plan in diffusers: --sp {dims.sp} is not supported"
        )
    # A plan of ours whose attention is written for Ulysses' gather alone (HunyuanVideo 1.5's) says so.
    if dims.ring > 1 and getattr(transformer, "_cp_ulysses_only", False):
        raise ParallelismUnsupported(
            f"{name}'s split attention runs on Ulysses alone: use --attention-split ulysses"
        )
    # Read off the attention modules: the config's name for it differs between models. Grouped keys
    # and values (Cosmos3's num_key_value_heads) are split among the ranks too.
    kinds = {"heads": "attention", "num_attention_heads": "attention", "num_key_value_heads": "key/value"}
    heads = {
        (count, kind)
        for m in transformer.modules()
        if hasattr(m, "processor")
        for attribute, kind in kinds.items()
        if isinstance(count := getattr(m, attribute, None), int)
    }
    if undivided := sorted((count, kind) for count, kind in heads if count % dims.ulysses):
        count, kind = undivided[0]
        raise ParallelismUnsupported(
            f"{name} has {count} {kind} heads: not divisible by the Ulysses degree {dims.ulysses}"
        )


@dataclass
class SequenceParallel:
    """This process's place among the sequence-parallel ranks (one rank without --sp)."""

    dims: ParallelDims = ParallelDims()
    rank: int = 0
    local_rank: int = 0
    timeout_seconds: float = 120.0
    helpers: list["ForkedRank"] = field(default_factory=list)  # ranks this process forked
    # Coordination (commands, flags) runs on a gloo group: on the CPU even when the model uses NCCL.
    cpu_group: Any = None
    mesh: DeviceMesh | None = None  # dims MESH_DIMS; diffusers splits attention over it

    @property
    def degree(self) -> int:
        return self.dims.sp

    @property
    def enabled(self) -> bool:
        return self.degree > 1

    @property
    def attention_split(self) -> str:
        return self.dims.attention_split if self.enabled else "none"

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
        """Apply diffusers' context parallelism over the mesh; ParallelismUnsupported if it cannot."""
        if not self.enabled:
            return
        check_splittable(transformer, self.dims)
        config = ContextParallelConfig(
            ulysses_degree=self.dims.ulysses,
            ring_degree=self.dims.ring,
            ulysses_anything=self.dims.uneven_text,
            mesh=self.mesh,
        )
        transformer.enable_parallelism(config=config)

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

    def gather_text(self, text: str) -> list[str]:
        """Every rank's ``text``, rank 0 first (an all-gather on the CPU group)."""
        if not self.enabled:
            return [text]
        gathered: list[Any] = [None] * self.degree
        self._collective("gather", lambda: dist.all_gather_object(gathered, text, group=self.cpu_group))
        return gathered

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


class ForkedRank:
    """A helper rank forked by rank 0 (``--sp N`` without a launcher), with the part of
    ``subprocess.Popen``'s interface that ``SequenceParallel`` uses.

    A fork rather than a new interpreter: rank 0 has imported torch and the model libraries and has
    set no thread count, run no kernel, started no thread and opened no socket or CUDA context yet
    (``fork_ranks`` is called first), so the fork starts at once where a new interpreter spends
    seconds importing them again, and it shares their pages."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def fork(cls, rank: int) -> "ForkedRank | None":
        """Fork rank ``rank``: its handle in this process, None in the fork (which goes on as that rank)."""
        if torch.cuda.is_initialized():
            raise ParallelismUnsupported("CUDA was initialised before the ranks were forked")
        sys.stdout.flush()  # or what the buffers hold is written twice
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
            return None
        return cls(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def plan(degree: int, attention_split: str, device: str) -> ParallelDims:
    """The ranks' layout: ``--sp`` and ``--attention-split``, or the launcher's world (under torchrun
    --sp may be left out: the launched ranks are the SP ranks). ValueError if the options disagree;
    ParallelismUnsupported if this machine cannot run the split."""
    launched = "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if launched else degree
    dims = ParallelDims(world_size if launched and degree == 1 else degree, attention_split, world_size)
    if dims.sp > 1 and _backend(device) == "gloo" and dims.ring > 1:
        raise ParallelismUnsupported(
            "ring attention needs GPUs (no CPU log-sum-exp kernel): use --attention-split ulysses"
        )
    return dims


def fork_ranks(dims: ParallelDims) -> list[ForkedRank]:
    """``--sp N`` without a launcher: fork ranks 1 .. N - 1 of this process, which goes on as rank 0.
    Call it before torch starts a thread pool (``torch.set_num_threads``, or the first kernel): a
    pool's threads do not survive a fork, and the fork's first parallel kernel would hang on OpenMP's
    or fail on torch's own. In a fork, and under a launcher, no helpers: []."""
    if dims.sp == 1 or "WORLD_SIZE" in os.environ:
        return []
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(dims.sp))
    os.environ.update(RANK="0", LOCAL_RANK="0")
    helpers = []
    for rank in range(1, dims.sp):
        helper = ForkedRank.fork(rank)
        if helper is None:  # this process is the new rank, and the ranks forked before it are not its own
            return []
        helpers.append(helper)
    return helpers


def start(
    dims: ParallelDims, timeout_seconds: float, device: str, helpers: list[ForkedRank]
) -> SequenceParallel:
    """Join the process group of ``dims``'s ranks (torchrun's, or those ``fork_ranks`` made) and build
    its mesh; ``helpers``: the ranks this process forked."""
    if dims.sp == 1:
        return SequenceParallel(dims)
    backend = _backend(device)
    group = SequenceParallel(
        dims=dims,
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        timeout_seconds=timeout_seconds,
        helpers=helpers,
    )
    if backend == "nccl":
        torch.cuda.set_device(group.local_rank)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    dist.init_process_group(backend, timeout=timeout)
    group.cpu_group = (
        dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    )
    group.mesh = dims.build_mesh("cuda" if backend == "nccl" else "cpu")
    log.info("rank %d of %d ready (pid %d, %s)", group.rank, dims.world_size, os.getpid(), backend)
    return group
