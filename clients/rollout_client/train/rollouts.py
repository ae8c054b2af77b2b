"""Rollouts from the trainer's side: the request of an iteration, the stream with its stall watchdog,
and the retry policy for a server that fails."""

import itertools
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch
from tqdm import tqdm

from rollout.v1 import rollout_pb2
from rollout_client import Collector, Preview, RolloutClient, Step, Trajectory
from rollout_client.events import decode_stream
from rollout_client.failures import SERVER_FAILURES
from rollout_client.grpo import sde_window
from rollout_client.train.prompts import iteration_prompts

if TYPE_CHECKING:
    from rollout_client.train.config import TrainConfig


MAX_RETRY_PAUSE = 30.0  # seconds; the pauses double from 1 s up to this


REPORT_SECONDS = 10.0  # while a call waits on the server, a line at least this often


# A server that is down is tried about once a second, not after gRPC's reconnect backoff (up to 2 min).
CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 1000)]


T = TypeVar("T")


@dataclass
class Rollout:
    """One iteration's samples, as they stream in."""

    collector: Collector = field(default_factory=Collector)
    seconds: float = 0.0
    prune_asked: int = 0  # nodes --prune-at asked the server to stop
    prune_stopped: int = 0  # of those, the nodes the server answered it stopped

    @property
    def trajectories(self) -> list[Trajectory]:
        return self.collector.trajectories()

    @property
    def policy_version(self) -> int:
        return self.collector.started.message.policy_version


def stochastic_steps(collector: Collector) -> list[int]:
    return [i for i, stochastic in enumerate(collector.started.message.stochastic) if stochastic]


def rollout_request(
    config: "TrainConfig", iteration: int, min_version: int, latents: int, preview_steps: list[int] = ()
) -> rollout_pb2.RolloutRequest:
    """Iteration ``iteration``'s request: its prompts, seeds never repeated across iterations, the
    --window's stochastic steps (with --tree-sde forks, the tree's branch steps), the algorithm's
    ``latents`` selection and ``preview_steps``, and the policy it needs."""
    generator = torch.Generator().manual_seed(config.seed + iteration)
    window = (
        sde_window(config.rollout.steps, config.rollout.window, generator) if config.rollout.window else []
    )
    branches = branch_points(config.tree.points)
    if config.tree.sde == "forks":  # early branching: the leaves differ only where they fork
        window = [branch.step for branch in branches]
    samples = config.rollout.prompts * config.rollout.group_size
    return rollout_pb2.RolloutRequest(
        request_id=f"grpo-iter-{iteration}",
        prompts=iteration_prompts(config, iteration),
        samples_per_prompt=config.rollout.group_size,
        base_seed=config.seed + iteration * samples,  # per-sample seeds never repeat across iterations
        num_steps=config.rollout.steps,
        height=config.rollout.size,
        width=config.rollout.size,
        sampler=rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
        noise_level=config.rollout.noise_level,
        stochastic_steps=window,
        latents=latents,
        min_policy_version=min_version,
        true_cfg_scale=config.rollout.cfg,
        branches=branches,
        # The early-termination rule scores each node's preview (its decoded x0_hat) at that step; the
        # server waits for its prune after it.
        preview_steps=sorted(set(preview_steps) | ({config.tree.prune_at} - {None})),
        prune_points=[] if config.tree.prune_at is None else [config.tree.prune_at],
    )


def say(message: str) -> None:
    tqdm.write(f"train_grpo: {message}", file=sys.stderr)


class ServerStalled(Exception):
    """A call the watchdog gave up on: the server sent nothing for ``--stall-timeout`` seconds."""


class ServerFailure(Exception):
    """The server failed for good (after the retries), refused a call, or serves other weights than
    the trainer pushed: the run stops, with one line saying why."""


class Watchdog:
    """Watches a server call from a thread of its own. While the trainer waits on the server it says
    so every ``REPORT_SECONDS`` (a quarter of ``stall_seconds`` when that is shorter); once it has
    waited ``stall_seconds`` without progress it calls ``cancel``, if given (a unary call ends on
    its own deadline instead). Time the trainer spends on its own work between events is not waiting."""

    def __init__(self, what: str, stall_seconds: float, cancel: Callable[[], None] | None = None):
        self.what, self.stall_seconds, self.cancel = what, stall_seconds, cancel
        self.stalled = False
        self.waiting_since: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"watchdog {what}", daemon=True)

    def __enter__(self) -> "Watchdog":
        self.waiting_since = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def watched(self, items: Iterator[T]) -> Iterator[T]:
        """``items``, timing the wait for each."""
        while True:
            self.waiting_since = time.monotonic()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                self.waiting_since = None
            yield item

    def _watch(self) -> None:
        interval = min(REPORT_SECONDS, self.stall_seconds / 4)
        while not self._done.wait(interval):
            since = self.waiting_since
            waited = 0.0 if since is None else time.monotonic() - since
            if waited >= self.stall_seconds and self.cancel is not None:
                say(f"{self.what}: nothing from the server for {waited:.0f} s, giving up on the call")
                self.stalled = True
                self.cancel()
                return
            if waited >= interval:
                say(f"{self.what}: waiting for the server, {waited:.1f} s of {self.stall_seconds:g}")


def stream(client: RolloutClient, request, stall_seconds: float, on_step=None) -> Rollout:
    """Run one rollout, storing each event as it arrives; ``on_step(rollout, step)`` after every step,
    once its previews have arrived too at the request's ``preview_steps``. The call has no deadline,
    since its length depends on the server's load; a server that sends nothing for ``stall_seconds``
    ends it with ServerStalled."""
    rollout, start = Rollout(), time.perf_counter()
    call = client.call("Rollout", request, timeout=None)
    previewed = set(request.preview_steps)
    waiting: Step | None = None  # a step whose previews are on their way
    with Watchdog(f"rollout {request.request_id}", stall_seconds, call.cancel) as watchdog:
        try:
            for event in watchdog.watched(decode_stream(call)):
                rollout.collector.add(event)
                if on_step is None:
                    continue
                if isinstance(event, Step) and event.index in previewed:
                    waiting = event
                elif isinstance(event, Step):
                    on_step(rollout, event)
                elif isinstance(event, Preview) and event.last and waiting is not None:
                    on_step(rollout, waiting)
                    waiting = None
        except grpc.RpcError as error:
            if watchdog.stalled:
                raise ServerStalled(f"no event from the server for {stall_seconds:g} s") from error
            raise
        finally:
            call.cancel()
    if rollout.collector.finished is None:
        raise RuntimeError(f"rollout {request.request_id} ended without its finished event")
    rollout.seconds = time.perf_counter() - start
    return rollout


def describe(error: Exception) -> str:
    """A failure on one line: the gRPC status and its message, or the exception's text."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        text = f"{error.code().name}: {error.details()}"
    else:
        text = str(error)
    return " ".join(text.split())


def retrying(what: str, attempt: Callable[[], T], retries: int, address: str) -> T:
    """``attempt()``; after a server failure (SERVER_FAILURES, or a stall) it is tried again up to
    ``retries`` times, after pauses of 1, 2, 4 ... MAX_RETRY_PAUSE seconds. Any other gRPC error, or
    the last failure, raises ServerFailure."""
    for retry in itertools.count():
        try:
            return attempt()
        except (grpc.RpcError, ServerStalled) as error:
            reason = describe(error)
            transient = isinstance(error, ServerStalled) or (
                hasattr(error, "code") and error.code() in SERVER_FAILURES
            )
            if not transient:
                raise ServerFailure(f"{what}: the server at {address} refused it: {reason}") from error
            if retry == retries:
                raise ServerFailure(
                    f"{what}: the server at {address} failed {retry + 1} times, last with {reason}"
                ) from error
            pause = min(2.0**retry, MAX_RETRY_PAUSE)
            say(
                f"{what}: the server at {address} failed ({reason}); "
                f"retry {retry + 1} of {retries} in {pause:g} s"
            )
            time.sleep(pause)


def branch_points(text: str) -> list[rollout_pb2.Branch]:
    """--tree's ``step:factor[:noise_level],...`` as a request's branches (none for ""); ValueError
    naming an item that is not one, or whose noise level is not finite and above 0."""
    points = []
    for item in filter(None, text.split(",")):
        fields = item.split(":")
        try:
            if len(fields) not in (2, 3):
                raise ValueError(item)
            branch = rollout_pb2.Branch(step=int(fields[0]), factor=int(fields[1]))
            if len(fields) == 3:
                branch.noise_level = float(fields[2])
        except ValueError:
            raise ValueError(f"not step:factor[:noise_level]: {item!r}") from None
        if branch.HasField("noise_level") and not 0 < branch.noise_level < math.inf:
            raise ValueError(f"{item!r}: its noise level must be finite and above 0")
        points.append(branch)
    return points


class Prefetch:
    """--async: the next iteration's rollout, streaming on a thread of its own while this one trains.
    ``start`` it, ``take`` it (None when none was started); use it as a context manager, which waits
    for a rollout still streaming when the run ends."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(1)
        self._upcoming: Future | None = None

    def start(self, client: RolloutClient, request: rollout_pb2.RolloutRequest, stall_seconds: float) -> None:
        self._upcoming = self._executor.submit(stream, client, request, stall_seconds)

    def take(self) -> "Rollout | None":
        """The prefetched rollout (its failure raised here), or None."""
        upcoming, self._upcoming = self._upcoming, None
        return None if upcoming is None else upcoming.result()

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc) -> None:
        self._executor.shutdown()
