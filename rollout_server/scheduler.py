"""Which rollouts run, and when: bounded FIFO admission, policy-version barriers, parked streams.

Rollouts and weight updates wait in one queue, in arrival order. The engine's worker asks for a
``Round`` before each batched step; the scheduler decides it:

* **drop**: rollouts whose stream has ended (the caller left, its deadline passed, or it stalled);
  queued ones are dropped before they cost anything, as are queued updates whose caller left.
* **join**: rollouts join the running set from the head of the queue while their samples fit in
  ``max_running_samples`` and their estimated memory fits the memory budget with the running ones'
  (a rollout joins an empty set whatever its size; admission refuses one that cannot fit the budget
  alone). The first one that does not fit waits, and everything behind it waits too: strictly FIFO,
  so a large request is never starved by small ones behind it.
* **barrier**: a weight update at the head of the queue stops later rollouts from joining; once the
  running rollouts (all started on the old weights) have finished, the update is applied alone, and
  the rollouts behind it start on the new weights. No rollout ever mixes two policy versions.
* **memory release**: a release of the weights' memory is an update like the others: it waits for
  the rollouts queued before it. From its submission until a resume, rollouts are refused
  (MemoryReleased), so none ever waits behind it for a model that is gone;
* **side jobs**: short jobs that must run on the worker between two rounds but change nothing a
  rollout computes (starting and installing a weight-sync group's join) run first, with no barrier;
* **prune**: nodes of tree rollouts that a PruneRollout asked to stop since the last round; the
  engine applies them before the round's steps and answers each call with what it stopped (the
  answer is what happened, not a forecast: a prune that comes after the rollout's last step stops
  nothing, and says so);
* **step**: every running rollout takes its next step together, except the parked and the held
  ones. A rollout whose client has not yet taken its buffered messages (``Outbox.full``) stays out
  of the batch, its state kept, until the client reads again (or the stream's stall limit ends it).
  A rollout that has just taken one of its ``prune_points`` is held the same way until a prune of it
  arrives (its caller decided on the step it saw) or ``prune_hold_seconds`` pass.

Bounds: at most ``max_queued`` rollouts queued or running (more get RESOURCE_EXHAUSTED), and at most
``max_image_bytes`` of conditioning-image pixels held by the queued ones (likewise), at most
``max_running_samples`` samples running (or one larger rollout alone) within the memory budget, per
stream at most ``STREAM_BUFFER`` messages plus one event's messages buffered, and a hold of at most
``prune_hold_seconds`` per prune point. A parked or held rollout delays itself alone: the worker
never waits on it.
"""

import asyncio
import hmac
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout.v1 import rollout_pb2
from rollout_core.tree import Tree, widest
from rollout_server.errors import (
    ForeignRollout,
    InvalidRequest,
    MemoryReleased,
    Overloaded,
    PruneTooLate,
    UnknownRollout,
)
from rollout_server.limits import Limits
from rollout_server.memory import MemoryBudget, RolloutMemory

if TYPE_CHECKING:
    from rollout_server.images import ConditionImage

# Messages a stream may hold unsent before its rollout is parked.
STREAM_BUFFER = 8


@dataclass(frozen=True)
class StreamEnd:
    """The last item of an outbox: the rollout's outcome (None: it finished)."""

    error: BaseException | None


class Outbox:
    """A rollout's messages on their way from the engine's worker thread to its gRPC handler, which
    iterates them (the rollout's failure is raised at the end) and closes the outbox when done. The
    worker never waits on it: while it holds ``limit`` messages or more, the scheduler parks the
    rollout, and ``taken`` wakes the scheduler when it drains."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake, limit: int = STREAM_BUFFER):
        self._loop = loop
        self._wake = wake
        self.limit = limit
        self._queue: asyncio.Queue = asyncio.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self.closed = False  # the handler is done with the stream: the rollout is dropped
        self._handed_out = False  # a message was handed to the handler and not yet counted taken

    @property
    def full(self) -> bool:
        return self._pending >= self.limit

    def put(self, message: rollout_pb2.RolloutResponse) -> None:
        """(worker) Queue a message for the stream; dropped once the stream has ended."""
        with self._lock:
            if self.closed:
                return
            self._pending += 1
        self._loop.call_soon_threadsafe(self._queue.put_nowait, message)

    def end(self, error: BaseException | None) -> None:
        """(worker) The rollout finished (``error`` None) or failed."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, StreamEnd(error))

    def __aiter__(self) -> "Outbox":
        return self

    async def __anext__(self) -> rollout_pb2.RolloutResponse:
        """(handler) The next message, once the one before it has gone out; at the end, the rollout's
        failure, if it failed."""
        if self._handed_out:
            self._handed_out = False
            self.taken()
        item = await self._queue.get()
        if isinstance(item, StreamEnd):
            if item.error is not None:
                raise item.error
            raise StopAsyncIteration
        self._handed_out = True
        return item

    def taken(self) -> None:
        """(handler) One message has gone out."""
        with self._lock:
            self._pending -= 1
            unparked = self._pending == self.limit - 1
        if unparked:
            self._wake()

    def close(self) -> None:
        """(handler) The stream is over, whatever happened: the scheduler drops the rollout."""
        self.closed = True
        self._wake()


@dataclass(frozen=True)
class PruneAnswer:
    """What a prune did: every node of the tree stopped so far, and the first step they do not take."""

    nodes: list[int]
    step: int


@dataclass(frozen=True)
class Prune:
    """A PruneRollout on its way to the worker; ``answer`` ends with a PruneAnswer or the failure."""

    nodes: list[int]
    answer: Future = field(default_factory=Future)


def new_control_token() -> str:
    """A rollout's control token: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


@dataclass(eq=False)
class RolloutJob:
    request: rollout_pb2.RolloutRequest  # resolved, without its conditioning images' files
    outbox: Outbox
    submitted_at: float  # perf_counter
    memory: RolloutMemory = RolloutMemory()  # its estimate (see memory.py)
    # Decoded at admission; the engine takes them when the rollout joins.
    condition_images: list["ConditionImage"] = field(default_factory=list)
    key: int = -1  # set by the scheduler: the rollout's id in the engine, on every rank
    parked_rounds: int = 0  # rounds it sat out while its client was slow to read
    tree: Tree | None = None  # a tree rollout's, for checking prunes
    prunes: list[Prune] = field(default_factory=list)  # to apply at the next round
    held_until: float | None = None  # (monotonic) held at a prune point until a prune, or then
    # What a control call must present: only the caller, who reads it in the started event, can.
    control_token: str = field(default_factory=new_control_token)
    # What its events become (see ``engine.RolloutEvents``); None: the stream's RolloutResponse messages.
    events: Any = None

    @property
    def samples(self) -> int:
        """Its widest point: a tree's leaves, a flat rollout's samples."""
        return widest(self.request)

    @property
    def dropped(self) -> bool:
        return self.outbox.closed

    def refuse_prunes(self, error: BaseException) -> None:
        """The rollout leaves before its pending prunes apply: their callers get ``error``."""
        for prune in self.prunes:
            if prune.answer.set_running_or_notify_cancel():  # else its caller left
                prune.answer.set_exception(error)
        self.prunes = []

    @property
    def image_bytes(self) -> int:
        return sum(image.nbytes for image in self.condition_images)


@dataclass(eq=False)
class UpdateJob:
    """A change of the served weights, or of the weight-sync group: ``run`` on the engine's worker,
    alone, once the rollouts queued before it have finished (or, for a side job, between two
    rounds); ``done`` ends with what it returns."""

    run: Callable[[], Any]
    done: Future = field(default_factory=Future)
    releases_memory: bool = False  # the weights' memory: rollouts are refused from its submission on

    @property
    def dropped(self) -> bool:
        return self.done.cancelled()  # its caller left before it ran


@dataclass
class Round:
    """What the engine does next: drop, join and step rollouts, or apply an update (alone)."""

    drop: list[int] = field(default_factory=list)  # keys of running rollouts to drop
    join: list[RolloutJob] = field(default_factory=list)
    prune: dict[int, list[int]] = field(default_factory=dict)  # key -> nodes of a tree rollout
    answers: dict[int, list[Future]] = field(default_factory=dict)  # key -> its prunes' answers (rank 0)
    step: list[int] = field(default_factory=list)  # keys of the rollouts that step, in join order
    side_jobs: list[UpdateJob] = field(default_factory=list)  # run first, no barrier
    update: UpdateJob | None = None
    stop: bool = False

    @property
    def moves_rollouts(self) -> bool:
        return bool(self.drop or self.join or self.prune or self.step)

    @property
    def idle(self) -> bool:
        return not (self.moves_rollouts or self.side_jobs or self.update or self.stop)


class Scheduler:
    def __init__(
        self,
        max_queued: int,
        max_running_samples: int,
        memory: MemoryBudget | None = None,
        prune_hold_seconds: float = Limits.prune_hold_seconds,
        max_image_bytes: int | None = None,
    ):
        self.max_queued = max_queued
        self.max_running_samples = max_running_samples
        self.memory = memory  # None: no memory bound
        self.prune_hold_seconds = prune_hold_seconds
        self.max_image_bytes = max_image_bytes  # of the queued rollouts' images; None: no bound
        self._changed = threading.Condition()
        self._queue: deque[RolloutJob | UpdateJob] = deque()
        self._side_jobs: list[UpdateJob] = []
        self.running: dict[int, RolloutJob] = {}
        self._keys = itertools.count()
        self._stopping = False
        # The weights are released, or being released: set as a release starts, cleared by a resume.
        self.memory_released = False

    @property
    def in_flight(self) -> int:
        """Rollouts queued or running whose stream is still open: a cancelled call frees its place at
        once, although the worker drops its rollout only at the next round."""
        with self._changed:
            running = sum(not job.dropped for job in self.running.values())
            return running + sum(isinstance(job, RolloutJob) and not job.dropped for job in self._queue)

    @property
    def queued(self) -> int:
        """Rollouts and weight updates waiting to start."""
        return len(self._queue)

    @property
    def queued_image_bytes(self) -> int:
        """The pixels of the conditioning images that queued rollouts hold."""
        with self._changed:
            return sum(
                job.image_bytes for job in self._queue if isinstance(job, RolloutJob) and not job.dropped
            )

    @property
    def refusing_rollouts(self) -> bool:
        """Whether rollouts are refused: the weights are released, or a release waits."""
        with self._changed:
            return self.memory_released or any(
                isinstance(job, UpdateJob) and job.releases_memory and not job.dropped for job in self._queue
            )

    def submit(self, job: RolloutJob) -> None:
        """Queue a rollout, or raise Overloaded (or MemoryReleased)."""
        with self._changed:  # a reentrant lock: in_flight takes it again
            if self.refusing_rollouts:
                raise MemoryReleased("the weights' memory is released: rollouts wait for it to be resumed")
            if (in_flight := self.in_flight) >= self.max_queued:
                raise Overloaded(f"{in_flight} rollouts queued or running (limit {self.max_queued})")
            held, limit = self.queued_image_bytes, self.max_image_bytes
            if job.image_bytes and limit is not None and held + job.image_bytes > limit:
                raise Overloaded(
                    f"queued rollouts hold {held} bytes of conditioning images; this one's "
                    f"{job.image_bytes} would pass the limit of {limit}"
                )
            job.key = next(self._keys)
            self._queue.append(job)
            self._changed.notify()

    def submit_update(self, run: Callable[[], Any]) -> Future:
        """Queue an update (``run`` applies it); the future ends once it is applied or has failed."""
        return self._submit_job(UpdateJob(run))

    def submit_release(self, run: Callable[[], Any]) -> Future:
        """Queue a release of the weights' memory (``run`` does it), behind the rollouts queued before
        it, and refuse rollouts from now on: while it waits, then while the weights are released
        (``memory_released``, set as it starts; a resume clears it). The future ends as
        ``submit_update``'s."""
        return self._submit_job(UpdateJob(run, releases_memory=True))

    def _submit_job(self, job: UpdateJob) -> Future:
        job.done.add_done_callback(lambda _: self.wake())  # a cancel frees its place at once
        with self._changed:
            self._queue.append(job)
            self._changed.notify()
        return job.done

    def submit_side_job(self, run: Callable[[], Any]) -> Future:
        """Have the worker ``run`` a side job before its next round, without waiting for the running
        rollouts; the future ends with what it returns."""
        job = UpdateJob(run)
        with self._changed:
            self._side_jobs.append(job)
            self._changed.notify()
        return job.done

    def prune(self, request_id: str, control_token: str, nodes: list[int]) -> Future:
        """Queue a prune of ``nodes`` of the tree rollout ``request_id`` for the next round, and release
        the rollout if it is held at a prune point. The returned future ends with a PruneAnswer once
        the engine has applied it, or PruneTooLate if the rollout had taken its last step, or ended,
        by then. Raises UnknownRollout if no running rollout has that id (a queued one's caller has
        no control token yet); ForeignRollout unless ``control_token`` is one of theirs (compared in
        constant time); InvalidRequest if the rollout is not a tree, or a node is not in its tree."""
        presented = control_token.encode()
        with self._changed:
            jobs = [
                job
                for job in self.running.values()
                if not job.dropped and job.request.request_id == request_id
            ]
            if not jobs:
                raise UnknownRollout("no rollout with this request id is running")
            matched = [job for job in jobs if hmac.compare_digest(job.control_token.encode(), presented)]
            if not matched:
                raise ForeignRollout(
                    "the control_token is not the rollout's: only the caller that started it (it reads the "
                    "token in the started event) may prune it"
                )
            job = matched[0]
            if job.tree is None:
                raise InvalidRequest([("request_id", "the rollout has no branches: it is not a tree")])
            if len(nodes) > len(job.tree):
                raise InvalidRequest([("nodes", f"more node ids than the tree's {len(job.tree)} nodes")])
            if unknown := [k for k, node in enumerate(nodes) if node >= len(job.tree)]:
                raise InvalidRequest(
                    [(f"nodes[{k}]", f"the rollout's tree has no node {nodes[k]}") for k in unknown]
                )
            prune = Prune(nodes)
            job.prunes.append(prune)
            job.held_until = None  # its caller has decided
            self._changed.notify()
            return prune.answer

    def hold(self, key: int) -> None:
        """(worker) Rollout ``key`` has just taken one of its prune points: it sits out the rounds
        until a prune of it comes, or ``prune_hold_seconds`` pass. Called before that step's event
        is sent, so no prune the event prompts can come before the hold."""
        with self._changed:
            if (job := self.running.get(key)) is not None:
                job.held_until = time.monotonic() + self.prune_hold_seconds

    def memory_resident(self) -> None:
        """(worker) The weights are in memory again, or a release failed and left them there: rollouts
        are admitted again, unless a later release waits."""
        with self._changed:
            self.memory_released = False

    def wake(self) -> None:
        """Something a round depends on changed (a stream drained or ended)."""
        with self._changed:
            self._changed.notify()

    def stop(self) -> None:
        """The next round is the last: the worker stops."""
        with self._changed:
            self._stopping = True
            self._changed.notify()

    def update(self, ended: dict[int, BaseException | None]) -> None:
        """After a round: the rollouts that ended in it (finished, ``None``, or failed) leave the
        running set, their streams end, and the prunes that came meanwhile are too late."""
        with self._changed:
            jobs = [(job, error) for key, error in ended.items() if (job := self.running.pop(key, None))]
            for job, _ in jobs:
                job.refuse_prunes(PruneTooLate("the rollout ended before the prune applied"))
        for job, error in jobs:
            job.outbox.end(error)

    def abandon(self) -> list[RolloutJob | UpdateJob]:
        """Empty the running set and the queue (the server stops); returns their jobs, whose callers
        are still waiting (updates not cancelled meanwhile)."""
        with self._changed:
            jobs = [*self.running.values()] + [
                job
                for job in (*self._queue, *self._side_jobs)
                if isinstance(job, RolloutJob) or job.done.set_running_or_notify_cancel()
            ]
            self._queue.clear()
            self._side_jobs.clear()
            self.running.clear()
            return jobs

    def next_round(self, timeout: float) -> Round:
        """The next round; an idle one after ``timeout`` seconds with nothing to do. A hold that ends
        meanwhile wakes it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                planned = self._plan()
                now = time.monotonic()
                if not planned.idle or now >= deadline:
                    return planned
                holds = [job.held_until for job in self.running.values() if job.held_until is not None]
                self._changed.wait(max(min([deadline, *holds]) - now, 0.0))

    def _fits_with_running(self, job: RolloutJob) -> bool:
        if self.memory is None:
            return True
        return self.memory.fits([*(running.memory for running in self.running.values()), job.memory])

    def _plan(self) -> Round:
        if self._stopping:
            return Round(stop=True)
        planned = Round(drop=[key for key, job in self.running.items() if job.dropped])
        planned.side_jobs = [job for job in self._side_jobs if job.done.set_running_or_notify_cancel()]
        self._side_jobs.clear()
        for key in planned.drop:
            self.running.pop(key).refuse_prunes(PruneTooLate("the rollout's stream ended first"))
        self._queue = deque(job for job in self._queue if not job.dropped)
        samples = sum(job.samples for job in self.running.values())
        while self._queue and isinstance(head := self._queue[0], RolloutJob):
            if self.running and (
                samples + head.samples > self.max_running_samples or not self._fits_with_running(head)
            ):
                break
            self._queue.popleft()
            self.running[head.key] = head
            planned.join.append(head)
            samples += head.samples
        if not (self.running or planned.drop or planned.join) and self._queue:
            update = self._queue.popleft()  # an update's barrier is reached: it runs alone
            if update.done.set_running_or_notify_cancel():
                planned.update = update
                self.memory_released |= update.releases_memory
            return planned
        now = time.monotonic()
        for key, job in self.running.items():
            prunes, job.prunes = [p for p in job.prunes if p.answer.set_running_or_notify_cancel()], []
            if prunes:  # those whose callers are still there
                planned.prune[key] = [node for prune in prunes for node in prune.nodes]
                planned.answers[key] = [prune.answer for prune in prunes]
            if job.held_until is not None and job.held_until <= now:
                job.held_until = None  # no prune came within the bound: it goes on
        planned.step = [
            key for key, job in self.running.items() if not job.outbox.full and job.held_until is None
        ]
        if planned.step:
            for job in self.running.values():
                job.parked_rounds += job.outbox.full
        return planned
