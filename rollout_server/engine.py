"""The rollout engine: one worker thread that owns the model and runs rounds of batched steps.

Each round, the scheduler (``scheduler.py``) says which rollouts drop, join and step, or which weight
update to apply; the runner (``runner.py``) encodes the joining requests and computes one batched
velocity for the rollouts that step; the sampler (``sampler.py``) advances each rollout in float32;
the stream encoder (``stream.py``) turns what happened into messages for each rollout's outbox. A
rollout whose steps are done decodes its images one piece per round (an image, or a chunk of a
video's frames), so a cancel, a stall or a shutdown waits for one piece of work, never a whole
decode. The worker never waits on a client: a slow one parks its own rollout, and a rollout held at
one of its prune points (until its caller's prune, or the hold's bound) sits out rounds the same way.

Sequence parallelism: rank 0 broadcasts each round (the keys to drop and to step, and the requests
that join, with the pixels of their conditioning images as admission decoded them: no rank decodes a
file) and each update; the other ranks run the same round without streaming (``follow``), so every
rank forms the same forwards. A failure every rank meets alike (a request the split cannot
take, a non-finite step) ends that rollout on every rank; any other failure in a forward under
sequence parallelism is a ``RankFailure`` that takes the server down, since the ranks may be out of
step.
"""

import asyncio
import itertools
import logging
import resource
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rollout.v1 import rollout_pb2
from rollout_core import checksum, solvers
from rollout_server import memory
from rollout_server.errors import (
    InvalidRequest,
    MemoryReleased,
    PruneTooLate,
    RankFailure,
    ShuttingDown,
    WeightSyncFailed,
)
from rollout_server.families.base import FamilyAdapter, MediaShape, Sound
from rollout_server.metrics import ServerMetrics
from rollout_server.parallel import SequenceParallel
from rollout_server.parallel.protocol import (
    HEARTBEAT,
    RELEASE,
    RESUME,
    ROUND,
    STOP,
    SYNC_COMMANDS,
    UPDATE,
    Joining,
    decode_round,
    encode_round,
)
from rollout_server.policy import Policy
from rollout_server.residency import Moved, Weights
from rollout_server.runner import Rollout, Runner, tree_of
from rollout_server.sampler import advance
from rollout_server.scheduler import (
    STREAM_BUFFER,
    Outbox,
    PruneAnswer,
    RolloutJob,
    Round,
    Scheduler,
    UpdateJob,
)
from rollout_server.stream import StreamEncoder, latents_sent, started_event
from rollout_server.weight_sync import GroupMembership

if TYPE_CHECKING:
    from rollout_server.images import ConditionImage
    from rollout_server.limits import Limits
    from rollout_server.parallel.sync_group import WeightSyncOptions
    from rollout_server.weights import group
    from rollout_server.weights.update import WeightUpdate

log = logging.getLogger("rollout_server.engine")


@dataclass(frozen=True)
class MemoryChange:
    """What a release or resume of the weights' memory did."""

    released: bool  # the weights are released after it
    changed: bool  # False: it was a no-op
    bytes: int  # moved off the device or back, summed over the ranks


@dataclass(frozen=True)
class EngineStatus:
    """What the engine serves and holds right now."""

    policy_version: int
    lora_adapters: dict[str, rollout_pb2.LoraAdapter]  # the served LoRA adapter, by transformer
    in_flight: int  # rollouts queued or running whose stream is still open
    running: int  # rollouts in the running set (stepping, decoding or parked)
    queued: int  # rollouts and weight updates waiting to start
    weights_checksum: str  # of the policy served (rollout_core.checksum)
    # Each transformer's own: the checksum of its tensors (and its adapter's) alone, by component.
    transformer_checksums: dict[str, str]
    weight_sync: "WeightSyncOptions | None"  # the weight-sync group joined, if any
    memory_released: bool  # rollouts are refused: the weights are released, or a release waits


class Engine:
    """The model on one worker thread, behind the small API the gRPC layer calls:

    * ``open_stream(resolved)``: queue a rollout; iterate its encoded messages, then ``close()`` it;
    * ``prune(request_id, control_token, nodes)``: stop nodes of a tree rollout at its next step;
    * ``check_update(update)``, then ``update_weights(update)``: apply a weight update between rollouts;
    * ``release_memory()`` and ``resume_memory()``: the weights' memory, for a colocated trainer;
    * ``join_weight_sync(options)``, ``check_group_update(manifest)``, then ``update_from_group(...)``,
      and ``leave_weight_sync()``: the same over a weight-sync group, every rank receiving;
    * ``status()``: the policy served and the rollouts held; ``close()``: stop.

    ``on_fatal`` is called from the worker thread when no later round is safe (the rank group broke):
    the server must go down. ``metrics`` receives what the engine observes.
    """

    def __init__(
        self,
        load_adapter: Callable[[], FamilyAdapter],
        model_name: str,
        limits: "Limits",
        parallel: SequenceParallel | None = None,
        prompt_cache_entries: int = 0,
        metrics: ServerMetrics | None = None,
        on_fatal: Callable[[Exception], None] | None = None,
    ):
        self.parallel = parallel or SequenceParallel()
        self.model_name = model_name
        self.max_message_bytes = limits.max_message_bytes
        self.metrics = metrics or ServerMetrics()
        self._on_fatal = on_fatal or (lambda error: None)
        self._rollouts: dict[int, Rollout] = {}  # the running rollouts' model-side state, by key
        self._ended: dict[int, BaseException | None] = {}  # the rollouts that ended this round
        # The worker also loads the model: CPU kernels run up to 2x slower on a thread other than the
        # one that loaded it. It starts its rounds once the engine is assembled.
        self._ready = threading.Event()
        loaded: Future = Future()
        self._worker = threading.Thread(target=self._lead, args=(load_adapter, loaded), name="rollout-worker")
        self._worker.daemon = True
        if self.parallel.is_leader:
            self._worker.start()
            self.adapter: FamilyAdapter = loaded.result()
        else:
            self.adapter = load_adapter()
        # Sized once the model is loaded: the default budget is a share of what the device has left.
        self.memory_budget = memory.MemoryBudget(
            limits.memory_budget or memory.default_budget(self.adapter.device, self.parallel.degree), limits
        )
        self.scheduler = Scheduler(
            limits.max_queued_requests,
            limits.max_running_samples,
            self.memory_budget,
            prune_hold_seconds=limits.prune_hold_seconds,
            max_image_bytes=limits.max_queued_image_bytes,
        )
        self._vae_profile = self.adapter.measure_vae() if self.parallel.is_leader else None
        self.policy = Policy(self.adapter.experts, self.parallel)
        modules = self.adapter.pipe.components.items()
        self.weights = Weights(
            {name: module for name, module in modules if isinstance(module, torch.nn.Module)},
            self.adapter.device,
        )
        self.runner = Runner(
            self.adapter,
            self.parallel,
            limits,
            prompt_cache_entries,
            self.metrics,
        )
        self.weight_sync = GroupMembership(
            self.parallel, self.policy, self.scheduler, self.adapter.device, self._check_resident
        )
        self.transformers = tuple(self.adapter.experts)  # the pipeline components an update may target
        self.max_update_bytes = self.policy.spec.max_update_bytes
        self.metrics.watch(self.status)
        self._ready.set()

    def check_fits(self, resolved: rollout_pb2.RolloutRequest) -> memory.RolloutMemory:
        """The memory a resolved request's rollout takes (see ``memory.estimate``); InvalidRequest,
        naming the fields that make it large, when it cannot fit the memory budget even alone."""
        backlog = STREAM_BUFFER * self.max_message_bytes
        split = self.parallel.dims.seq_len_divisor
        estimate = memory.estimate(self.adapter, self._vae_profile, resolved, backlog, split)
        video = self.adapter.max_frames > 1
        if too_large := memory.refusal(estimate, self.memory_budget, resolved, video):
            raise InvalidRequest(too_large)
        return estimate

    def sample_sizes(self, resolved: rollout_pb2.RolloutRequest) -> memory.SampleSizes:
        """One sample's latent elements and one text's env bytes at a resolved request's shape."""
        return memory.sample_sizes(self.adapter, resolved)

    def open_stream(
        self, resolved: rollout_pb2.RolloutRequest, condition_images: list["ConditionImage"] = ()
    ) -> Outbox:
        """Queue a resolved rollout (on the running event loop's thread), with its conditioning images
        as admission decoded them (the request keeps no files). Iterating the returned stream gives its
        encoded RolloutResponse messages and raises its failure at the end; ``close()`` it once done,
        however it ended, which drops the rollout if it still runs. InvalidRequest if it cannot fit the
        memory budget, Overloaded if the queue is full or holds too many images' pixels."""
        estimate = self.check_fits(resolved)
        stream = Outbox(asyncio.get_running_loop(), self.scheduler.wake)
        job = RolloutJob(resolved, stream, time.perf_counter(), estimate, list(condition_images))
        if resolved.branches:
            job.tree = tree_of(resolved)
        self.scheduler.submit(job)
        return stream

    def prune(self, request_id: str, control_token: str, nodes: list[int]) -> Future:
        """Stop nodes of a tree rollout at its next step; the future ends with what was stopped
        (see ``Scheduler.prune``)."""
        return self.scheduler.prune(request_id, control_token, nodes)

    def check_update(self, update: "WeightUpdate") -> None:
        """StaleUpdate or InvalidRequest unless ``update`` applies to the current weights; it changes
        nothing, and may take a while (a LoRA check builds an empty model): call it off the event loop.
        MemoryReleased while the weights are released."""
        self._check_resident()
        self.policy.check(update)

    def update_weights(self, update: "WeightUpdate") -> Future:
        """Queue a checked update behind the rollouts already queued (it is checked again when it
        runs); the future ends once every rank has applied it, or with its failure."""
        self._log_queued(update)

        def apply() -> None:
            self._check_resident()
            self.policy.apply(update)

        return self.scheduler.submit_update(apply)

    def _check_resident(self, before: str = "updating them") -> None:
        if self.weights.released:
            raise MemoryReleased(
                "the weights' memory is released: resume it (ResumeMemory, /resume_memory_occupation) "
                f"before {before}"
            )

    def release_memory(self) -> Future:
        """Release the weights' memory on every rank once the rollouts queued before have finished;
        rollouts are refused from now until ``resume_memory``. A release while released changes
        nothing. The future ends with a MemoryChange, or the failure (which frees nothing, and admits
        rollouts again)."""
        return self.scheduler.submit_release(self._release_on_every_rank)

    def resume_memory(self) -> Future:
        """Put the released weights back on every rank, behind what is queued, and admit rollouts
        again; a no-op unless released. The future ends with a MemoryChange, or the failure (the
        weights stay released)."""
        return self.scheduler.submit_update(self._resume_on_every_rank)

    def _release_on_every_rank(self) -> MemoryChange:
        if self.weights.released:
            return MemoryChange(released=True, changed=False, bytes=0)
        self.parallel.broadcast_command(RELEASE)
        try:
            moved = self._move_on_every_rank(self.weights.release)
        except Exception:
            self.scheduler.memory_resident()
            raise
        return MemoryChange(released=True, changed=True, bytes=moved)

    def _resume_on_every_rank(self) -> MemoryChange:
        if not self.weights.released:
            return MemoryChange(released=False, changed=False, bytes=0)
        self.parallel.broadcast_command(RESUME)
        moved = self._move_on_every_rank(self.weights.restore)
        self.scheduler.memory_resident()
        return MemoryChange(released=False, changed=True, bytes=moved)

    def _move_on_every_rank(self, move: Callable[[], Moved]) -> int:
        """``move`` the weights here, then learn whether every rank did: the bytes moved on all of them.
        A failure on one rank of several is a RankFailure: ranks that hold different weights, or some
        none, cannot serve together."""
        failure, moved = None, None
        try:
            moved = move()
        except Exception as error:  # noqa: BLE001 - raised below, here or as the ranks' failure
            failure = error
        if not self.parallel.all_succeeded(failure is None):
            if not self.parallel.enabled:
                raise failure
            raise RankFailure(
                f"rank {self.parallel.rank} could not move the weights' memory: {failure}"
                if failure is not None
                else f"another rank could not move the weights' memory; {self.parallel.describe_failure()}"
            ) from failure
        return sum(int(count) for count in self.parallel.gather_text(str(moved.bytes)))

    def _log_queued(self, update: "WeightUpdate") -> None:
        log.info(
            "weight update to version %d queued; it runs once the %d running rollouts finish",
            update.policy_version,
            len(self.scheduler.running),
        )

    def module_names(self, target: str) -> list[str]:
        """The paths of ``target``'s submodules, among which a LoRA adapter's target_modules select."""
        return [name for name, _ in self.policy.specs[target].empty_model.named_modules() if name]

    def tensor_sha256(self, target: str, names: Iterable[str]) -> dict[str, str]:
        """SGLang's SHA-256 (``checksum.tensor_sha256``) of each of ``names`` that ``target`` serves
        (``Policy.served_tensors``); the others are left out. It reads the live tensors: call it while
        no update runs. MemoryReleased while the weights are released (there is nothing to read)."""
        self._check_resident("reading them")
        served = self.policy.served_tensors(target)
        return {name: checksum.tensor_sha256(served[name]) for name in names if name in served}

    # The weight-sync group (weight_sync.GroupMembership).

    def check_weight_sync(self, request: rollout_pb2.InitWeightSyncRequest) -> "WeightSyncOptions":
        """The options of an InitWeightSync request for this server's ranks; InvalidRequest naming
        every bad field."""
        return self.weight_sync.check_init(request)

    def join_weight_sync(self, options: "WeightSyncOptions") -> Future:
        """Every rank joins the group, without holding a rollout (``GroupMembership.join``)."""
        return self.weight_sync.join(options)

    def leave_weight_sync(self) -> Future:
        """Every rank leaves its weight-sync group; the future says whether there was one."""
        return self.weight_sync.leave()

    def check_group_update(self, message: rollout_pb2.GroupUpdateManifest) -> "group.GroupManifest":
        """A group update's manifest, checked whole (``GroupMembership.check_update``)."""
        return self.weight_sync.check_update(message)

    def update_from_group(
        self, manifest: "group.GroupManifest", on_ready: Callable[[], None], start: Future
    ) -> Future:
        """Queue a checked group update; the future ends with a ``GroupApplied`` once every rank
        received and applied it, or the failure (``GroupMembership.update``)."""
        self._log_queued(manifest.update)
        return self.weight_sync.update(manifest, on_ready, start)

    def status(self) -> EngineStatus:
        return EngineStatus(
            policy_version=self.policy.version,
            lora_adapters=dict(self.policy.lora_adapters),
            in_flight=self.scheduler.in_flight,
            running=len(self.scheduler.running),
            queued=self.scheduler.queued,
            weights_checksum=self.policy.checksum,
            transformer_checksums=self.policy.transformer_checksums,
            weight_sync=self.weight_sync.options,
            memory_released=self.scheduler.refusing_rollouts,
        )

    def close(self) -> None:
        """Stop the worker (what is still queued or running fails with ShuttingDown), and release
        the other ranks."""
        self.scheduler.stop()
        self._worker.join(timeout=self.parallel.timeout_seconds)
        self.weights.close()
        self.weight_sync.close()

    def _lead(self, load_adapter: Callable[[], FamilyAdapter], loaded: Future) -> None:
        """Rank 0's worker: load the model, then run the scheduler's rounds, with heartbeats to the
        other ranks while idle."""
        try:
            loaded.set_result(load_adapter())
        except BaseException as error:
            loaded.set_exception(error)
            return
        self._ready.wait()
        try:
            while True:  # schedule, execute, update
                planned = self.scheduler.next_round(self.parallel.timeout_seconds / 4)
                if planned.stop:
                    self.parallel.broadcast_command(STOP)
                    self._end_all(ShuttingDown("the server is shutting down"))
                    return
                for job in planned.side_jobs:
                    self._lead_update(job)
                if planned.update is not None:
                    self._lead_update(planned.update)
                elif planned.idle:
                    self.parallel.broadcast_command(HEARTBEAT)
                elif planned.moves_rollouts:
                    self._lead_round(planned)
        except RankFailure as error:
            self._end_all(error)
            self._on_fatal(error)
        except BaseException as error:
            # Nothing else may escape a round; if it does, no later round is safe.
            # Under sequence parallelism this is mostly a collective inside a forward: name the ranks
            # known to be gone.
            failure = RankFailure(
                f"the engine failed: {self.parallel.describe_failure()}{type(error).__name__}: {error}"
            )
            failure.__cause__ = error
            log.exception("engine worker failed")
            self._end_all(failure)
            self._on_fatal(failure)

    def _lead_round(self, planned: Round) -> None:
        """Broadcast a round and run it; then its ended rollouts leave. A prune it did not apply (its
        rollout had ended, or the round failed) is answered PruneTooLate."""
        try:
            # Encoded only for other ranks to read: it copies the images' pixels.
            payload = encode_round(planned) if self.parallel.enabled else b""
            self.parallel.broadcast_command(ROUND, payload)
            joining = [(job.key, job.request, job.condition_images) for job in planned.join]
            for job in planned.join:
                job.condition_images = []  # the runner's now: freed once it has encoded them
            ended = self._run_round(planned.drop, joining, planned.prune, planned.step, planned.answers)
        finally:
            for answer in itertools.chain(*planned.answers.values()):
                if not answer.done():
                    answer.set_exception(PruneTooLate("the rollout ended before the prune applied"))
        self.scheduler.update(ended)

    def _lead_update(self, job: UpdateJob) -> None:
        try:
            result = job.run()
        except Exception as error:
            job.done.set_exception(error)
            if isinstance(error, RankFailure):
                raise
        else:
            job.done.set_result(result)

    def follow(self) -> None:
        """A non-leader rank's loop: run what rank 0 broadcasts until it says stop (then, or on a
        failure, delete the spill of weights still released and leave the weight-sync group)."""
        try:
            self._follow_commands()
        finally:
            self.weights.close()
            self.weight_sync.close()

    def _follow_commands(self) -> None:
        while True:
            command, payload = self.parallel.broadcast_command("")
            if command == STOP:
                return
            if command == ROUND:
                self._run_round(*decode_round(payload))
            elif command == UPDATE:
                self.policy.follow(payload)
            elif command in (RELEASE, RESUME):
                self._move_on_every_rank(self.weights.release if command == RELEASE else self.weights.restore)
            elif command in SYNC_COMMANDS:
                try:
                    self.weight_sync.follow(command, payload)
                except (WeightSyncFailed, InvalidRequest) as error:
                    log.info("rank %d: %s", self.parallel.rank, error)  # rank 0 answers the call

    def _run_round(
        self,
        drop: list[int],
        join: list[Joining],
        prune: dict[int, list[int]],
        step: list[int],
        answers: dict[int, list[Future]] | None = None,
    ) -> dict[int, BaseException | None]:
        """One round, alike on every rank (only rank 0 streams and has the prunes' ``answers``):
        tree rollouts drop their pruned nodes, the rollouts still denoising take a step, those
        decoding (rank 0) decode their next piece. Returns the rollouts that ended in it, each with
        its failure (None: it finished)."""
        self._ended = {}
        for key in drop:
            self._rollouts.pop(key, None)
        for key, request, condition_images in join:
            self._join(key, request, condition_images)
        for key, nodes in prune.items():
            if (rollout := self._rollouts.get(key)) is not None:
                self._prune(rollout, nodes, (answers or {}).get(key, []))
        stepping = [self._rollouts[key] for key in step if key in self._rollouts]
        denoising = [rollout for rollout in stepping if rollout.pieces is None]
        if denoising:
            self._step(denoising)
        for rollout in stepping:
            if rollout.pieces is not None:
                self._decode_piece(rollout)
        return self._ended

    def _prune(self, rollout: Rollout, nodes: list[int], answers: list[Future]) -> None:
        """Stop ``nodes`` of a tree rollout that is still denoising, and answer its prunes with what
        is stopped (before the step, so a caller never waits on a forward); with no node left, the
        rollout is done."""
        if rollout.done:  # its steps are over (it may be decoding)
            last = rollout.plan.num_steps - 1
            for answer in answers:
                answer.set_exception(
                    PruneTooLate(f"the rollout has taken its last step ({last}): none is left")
                )
            return
        pruned = rollout.prune(nodes)
        for answer in answers:
            answer.set_result(PruneAnswer(sorted(rollout.pruned), rollout.state.step))
        try:
            if rollout.stream is not None and pruned:
                rollout.stream.on_pruned(pruned, rollout.state.step)
            if rollout.done:
                self._denoised(rollout)
        except Exception as error:  # noqa: BLE001 - it fails this rollout only
            self._end(rollout.key, error)

    def _step(self, rollouts: list[Rollout]) -> None:
        began = time.perf_counter()
        velocities = self.runner.velocities(rollouts, self._dropped)
        for rollout in rollouts:
            if rollout.key in velocities.failures:
                self._end(rollout.key, velocities.failures[rollout.key])
                continue
            if rollout.key in velocities.cancelled:
                continue  # dropped: the next round removes it
            rollout.shared_steps += rollout.key in velocities.shared
            rollout.transformer_rows += len(rollout.rows)
            try:
                v = rollout.fork(velocities.guided[rollout.key])
                x = rollout.state.x  # x_i of the rows that take the step
                record = advance(rollout.plan, rollout.state, v)
                if rollout.stream is not None:
                    if record.index in rollout.request.prune_points:
                        self.scheduler.hold(rollout.key)  # before its caller can see the step
                    rollout.stream.on_step(record, rollout.live)
                    if record.index in rollout.request.preview_steps:
                        self._stream_previews(rollout, record.index, x, v)
                if rollout.done:
                    self._denoised(rollout)
            except Exception as error:  # noqa: BLE001 - it fails this rollout only
                self._end(rollout.key, error)
        self.metrics.batched_step(len(rollouts), time.perf_counter() - began)

    def _stream_previews(self, rollout: Rollout, step: int, x: torch.Tensor, v: torch.Tensor) -> None:
        """Rank 0: each row's x0_hat = x_i - sigma_i v_i at ``step``, decoded as the final images are
        (the same pieces, one at a time), streamed after the step's event and before the next
        step's, in this round: a rollout held at this step has sent them before its caller prunes."""
        x0_hat = solvers.data_prediction(x, v, rollout.plan.sigmas, step)
        pieces = self.runner.decode_pieces(x0_hat, MediaShape.of(rollout.request))
        previews = _media(pieces, rollout.live)
        pending = next(previews)
        for following in previews:  # one ahead: the last says so
            rollout.stream.on_preview(step, *pending, last=False)
            pending = following
        rollout.stream.on_preview(step, *pending, last=True)

    def _dropped(self, key: int) -> bool:
        """Whether the stream of rollout ``key`` has ended (rank 0 knows; the runner asks it)."""
        job = self.scheduler.running.get(key)
        return job is not None and job.dropped

    def _join(
        self, key: int, request: rollout_pb2.RolloutRequest, condition_images: list["ConditionImage"]
    ) -> None:
        joined_at = time.perf_counter()
        try:
            rollout = self.runner.prepare(key, request, condition_images)
        except InvalidRequest as error:  # every rank meets it: the split cannot take the lengths
            self._end(key, error)
            return
        except Exception as error:
            if self.parallel.enabled:
                raise  # the ranks may disagree about it now
            self._end(key, error)
            return
        rollout.times.update(joined=joined_at, encoded=time.perf_counter())
        self.metrics.prompt_cache(rollout.prompt_cache_hits, rollout.prompts_encoded)
        self._rollouts[key] = rollout
        job = self.scheduler.running.get(key)  # rank 0 only: its stream
        if job is None:
            return
        rollout.times["submitted"] = job.submitted_at
        started, env_tensors = started_event(
            rollout, self.adapter, self.model_name, self.policy.version, self.parallel
        )
        started.control_token = job.control_token
        rollout.stream = StreamEncoder(
            request=request,
            started=started,
            env_tensors=env_tensors,
            sent=latents_sent(request.latents, rollout.plan.stochastic),
            emit=self.metrics.counting(job.outbox.put),
            max_message_bytes=self.max_message_bytes,
        )
        try:
            rollout.stream.on_start(rollout.state.x)
        except Exception as error:  # noqa: BLE001 - it fails this rollout only
            self._end(key, error)

    def _denoised(self, rollout: Rollout) -> None:
        """The last step is done: rank 0 decodes the images, when asked for, a piece per round (so
        the rollout can park, be dropped or stop between pieces); otherwise it finishes now."""
        rollout.times["denoised"] = time.perf_counter()
        if rollout.stream is not None and rollout.request.images:
            # The decode holds the latents, not the rollout: a dropped rollout frees both at once.
            rollout.pieces = self.runner.decode_pieces(rollout.state.x, MediaShape.of(rollout.request))
        else:
            self._finish(rollout)

    def _decode_piece(self, rollout: Rollout) -> None:
        try:
            piece = next(rollout.pieces, None)
            if piece is None:
                self._finish(rollout)
                return
            for node, frame_index, media in _media([piece], rollout.live):
                if isinstance(media, Sound):
                    rollout.stream.on_audio(node, media)
                else:
                    rollout.stream.on_image(node, frame_index, media)
        except Exception as error:  # noqa: BLE001 - it fails this rollout only
            self._end(rollout.key, error)

    def _finish(self, rollout: Rollout) -> None:
        """The finished event (rank 0), and the end."""
        job = self.scheduler.running.get(rollout.key)
        if job is not None:
            times, finished_at = rollout.times, time.perf_counter()
            rollout.stream.on_finish(
                rollout_pb2.RolloutFinished(
                    encode_seconds=times["encoded"] - times["joined"],
                    denoise_seconds=times["denoised"] - times["encoded"],
                    decode_seconds=finished_at - times["denoised"],
                    total_seconds=finished_at - times["submitted"],
                    queue_seconds=times["joined"] - times["submitted"],
                    peak_memory_bytes=peak_memory_bytes(self.adapter.device),
                    prompt_cache_hits=rollout.prompt_cache_hits,
                    prompts_encoded=rollout.prompts_encoded,
                    shared_steps=rollout.shared_steps,
                    transformer_rows=rollout.transformer_rows,
                    parked_rounds=job.parked_rounds,
                )
            )
        self._end(rollout.key, None)

    def _end(self, key: int, error: BaseException | None) -> None:
        """The rollout ``key`` finished (``error`` None) or failed: free its model-side state; the
        scheduler ends its stream after the round."""
        self._rollouts.pop(key, None)
        self._ended[key] = error

    def _end_all(self, error: BaseException) -> None:
        """Fail whatever is queued or running (the server stops, or the rank group broke)."""
        self._rollouts.clear()
        for job in self.scheduler.abandon():
            if isinstance(job, UpdateJob):
                job.done.set_exception(error)
            else:
                job.refuse_prunes(error)
                job.outbox.end(error)


def _media(pieces: Iterable, nodes: list[int]) -> Iterator[tuple[int, int, Any]]:
    """(node, frame index, image or Sound) of ``Runner.decode_pieces``'s pieces, whose rows are the
    ``nodes``."""
    for piece in pieces:
        if isinstance(piece[1], Sound):
            row, sound = piece
            yield nodes[row], 0, sound
        else:
            row, first_frame, frames = piece
            for f, frame in enumerate(frames, start=first_frame):
                yield nodes[row], f, frame


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
