"""The rollout engine: one worker thread that owns the model and runs admitted rollouts in order.

A rollout runs on the worker: prompt encoding -> sampler loop (hooks stream every step) -> decoding.
Messages go back through ``emit``, which blocks while the client is slow to read (backpressure); a
caller that has gone away makes ``cancelled()`` true, and the rollout stops at its next step.

With sequence parallelism the leader (rank 0) broadcasts each rollout to the other ranks, which run
the same prepare and sampler loop without streaming (``follow``); every step starts with the ranks
agreeing on whether to go on, so a cancel stops all of them at the same step.

Weight updates are jobs on the same worker: one runs after the rollouts queued before it and before
later ones, so no rollout ever mixes two policy versions. A single-rank server whose update fails
while applying restores the previous weights and keeps serving. Under sequence parallelism rank 0
broadcasts the update and every rank applies it; a rank that cannot takes the server down
(``RankFailure``) rather than let the ranks serve different weights.
"""

import logging
import queue
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from rollout.v1 import rollout_pb2
from rollout_core import dtypes, noise, steps
from rollout_core.transformer_call import apply_guidance, call_transformer, stack_envs
from rollout_server import weights
from rollout_server.families.base import FamilyAdapter
from rollout_server.metrics import ServerMetrics
from rollout_server.parallel import HEARTBEAT, ROLLOUT, STOP, UPDATE, RankFailure, SequenceParallel
from rollout_server.prompt_cache import Conditioning, PromptCache
from rollout_server.sampler import (
    NonFiniteStep,
    RolloutCancelled,
    SamplerHooks,
    SamplerPlan,
    sample,
    stochastic_steps,
)
from rollout_server.stream import StreamEncoder, env_payload, latents_sent
from rollout_server.validation import InvalidRequest

log = logging.getLogger("rollout_server.engine")


@dataclass(frozen=True)
class PreparedRollout:
    """A request made ready to sample: the plan, the velocity and the started event."""

    plan: SamplerPlan
    velocity: Callable[[torch.Tensor, int], torch.Tensor]
    started: rollout_pb2.RolloutStarted  # without tensors
    env_tensors: dict[str, torch.Tensor]
    prompt_cache_hits: int  # distinct texts whose conditioning came from the prompt cache
    prompts_encoded: int  # distinct texts encoded for this rollout


class Overloaded(Exception):
    """Too many rollouts are queued or running."""


class RolloutEngine:
    """Runs rollouts on the loaded model, one at a time, with bounded admission."""

    def __init__(
        self,
        load_adapter: Callable[[], FamilyAdapter],
        model_name: str,
        max_queued: int,
        max_batch_size: int,
        max_message_bytes: int,
        parallel: SequenceParallel | None = None,
        prompt_cache_entries: int = 0,
    ):
        self.parallel = parallel or SequenceParallel()
        self.model_name = model_name
        self.max_queued = max_queued
        self.max_batch_size = max_batch_size
        self.max_message_bytes = max_message_bytes
        self.policy_version = 0
        self.lora_adapter: rollout_pb2.LoraAdapter | None = None
        self._admitted = 0
        self._lock = threading.Lock()
        # Called (from the worker thread) when the rank group broke: the server must go down.
        self.on_fatal: Callable[[Exception], None] = lambda error: None
        # One worker owns the model: rollouts run one after another, in admission order. It also loads
        # the model: CPU kernels run up to 2x slower on a thread other than the one that loaded it.
        self._jobs: queue.Queue = queue.Queue()
        loaded: Future = Future()
        self._worker = threading.Thread(target=self._lead, args=(load_adapter, loaded), name="rollout-worker")
        self._worker.daemon = True
        if self.parallel.is_leader:
            self._worker.start()
            self.adapter: FamilyAdapter = loaded.result()
        else:
            self.adapter = load_adapter()
        self.weight_spec = weights.TransformerSpec.of(self.adapter.transformer, self.parallel.enabled)
        # Used by the worker only (and on every rank alike: each sees the same requests in order).
        self.prompt_cache = PromptCache(self.adapter, prompt_cache_entries)
        self.metrics = ServerMetrics()
        self.metrics.watch(self)

    def submit(self, request, emit: Callable, cancelled: Callable[[], bool], admitted_at: float) -> Future:
        """Queue a resolved request for the worker; the future ends when its stream has been emitted."""
        return self._queue(lambda: self._lead_rollout(request, emit, cancelled, admitted_at))

    def submit_update(self, update: weights.WeightUpdate) -> Future:
        """Queue a checked weight update; the future ends once it is applied (and, under sequence
        parallelism, sent to the other ranks, which apply it or take the server down)."""
        return self._queue(lambda: self._lead_update(update))

    def _queue(self, work: Callable[[], None]) -> Future:
        future: Future = Future()
        self._jobs.put((future, work))
        return future

    @property
    def admitted(self) -> int:
        """Rollouts admitted and not yet finished."""
        return self._admitted

    @property
    def queued_jobs(self) -> int:
        """Rollouts and weight updates waiting for the worker."""
        return self._jobs.qsize()

    def close(self) -> None:
        """Stop the worker after the queued rollouts, and release the other ranks."""
        self._jobs.put(None)
        self._worker.join(timeout=self.parallel.timeout_seconds)

    def _lead(self, load_adapter: Callable[[], FamilyAdapter], loaded: Future) -> None:
        """Rank 0's worker: load the model, then run rollouts in order, with heartbeats to the other
        ranks while idle."""
        try:
            loaded.set_result(load_adapter())
        except BaseException as error:
            loaded.set_exception(error)
            return
        while True:
            try:
                job = self._jobs.get(timeout=self.parallel.timeout_seconds / 4)
            except queue.Empty:
                job = HEARTBEAT
            try:
                if job is None:
                    self.parallel.broadcast_command(STOP)
                    return
                if job == HEARTBEAT:
                    self.parallel.broadcast_command(HEARTBEAT)
                    continue
                future, work = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(work())
                except (RolloutCancelled, InvalidRequest, NonFiniteStep, weights.StaleUpdate) as error:
                    future.set_exception(error)  # every rank stopped at the same point
                except BaseException as error:
                    if self.parallel.enabled and not isinstance(error, RankFailure):
                        # The other ranks are mid-rollout or out of step: no later rollout is safe.
                        failure = RankFailure(f"rollout failed: {self.parallel.describe_failure()}{error}")
                        failure.__cause__ = error
                        error = failure
                    future.set_exception(error)
                    if isinstance(error, RankFailure):
                        raise error
            except RankFailure as error:
                self.on_fatal(error)
                return

    def _lead_rollout(self, request, emit, cancelled, admitted_at: float) -> None:
        if cancelled():
            raise RolloutCancelled(f"request {request.request_id} was cancelled while queued")
        self.parallel.broadcast_command(ROLLOUT, request.SerializeToString())
        self.execute(request, emit, lambda: self.parallel.agree(cancelled()), admitted_at)

    def _lead_update(self, update: weights.WeightUpdate) -> None:
        # Checked again now: an update queued behind another one may have gone stale meanwhile.
        self.check_update(update)
        if self.parallel.enabled:
            self.parallel.broadcast_command(UPDATE, weights.to_payload(update))
        self._apply_on_every_rank(lambda: update)

    def check_update(self, update: weights.WeightUpdate) -> None:
        """StaleUpdate or InvalidRequest unless ``update`` applies to the current weights. It changes
        nothing and reads no live tensor, so any thread may call it while rollouts run."""
        weights.check_version(update.policy_version, self.policy_version)
        weights.check(self.weight_spec, update)

    def _apply_update(self, update: weights.WeightUpdate) -> None:
        started_at = time.perf_counter()
        # If this fails, the previous weights are back in place (weights.apply restores them).
        self.lora_adapter = weights.apply(self.adapter.transformer, update, self.lora_adapter)
        self.policy_version = update.policy_version
        log.info("applied %s in %.3f s", update.describe(), time.perf_counter() - started_at)

    def follow(self) -> None:
        """A non-leader rank's loop: run what rank 0 broadcasts until it says stop."""
        while True:
            command, payload = self.parallel.broadcast_command("")
            if command == STOP:
                return
            if command == ROLLOUT:
                request = rollout_pb2.RolloutRequest.FromString(payload)
                try:
                    self.execute(request, lambda message: None, lambda: self.parallel.agree(False), 0.0)
                except (RolloutCancelled, InvalidRequest, NonFiniteStep):
                    continue  # rank 0 met the same (the gathered velocity is the same on every rank)
            elif command == UPDATE:
                self._follow_update(payload)

    def _follow_update(self, payload: bytes) -> None:
        def decoded() -> weights.WeightUpdate:
            update = weights.from_payload(payload)
            self.check_update(update)
            return update

        self._apply_on_every_rank(decoded)

    def _apply_on_every_rank(self, get_update: Callable[[], weights.WeightUpdate]) -> None:
        """Apply the update here, then learn whether every rank did. Ranks serving different weights
        would be worse than no server: under sequence parallelism any failure is a RankFailure on every
        rank (so the update call fails and the server goes down). A single rank restored its previous
        weights: the error fails the call only."""
        if not self.parallel.enabled:
            self._apply_update(get_update())
            return
        failure = None
        try:
            self._apply_update(get_update())
        except Exception as error:
            failure = error
        if not self.parallel.all_succeeded(failure is None):
            if failure is not None:
                raise RankFailure(
                    f"rank {self.parallel.rank} cannot apply the weight update: "
                    f"{type(failure).__name__}: {failure}"
                ) from failure
            raise RankFailure(
                f"another rank could not apply the weight update; {self.parallel.describe_failure()}"
            )

    def admit(self) -> None:
        """Reserve a place for one rollout, or raise Overloaded."""
        with self._lock:
            if self._admitted >= self.max_queued:
                raise Overloaded(f"{self._admitted} rollouts queued or running (limit {self.max_queued})")
            self._admitted += 1

    def release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def _micro_batches(self, prompt_indices: list[int], conditioning: Conditioning) -> list[tuple]:
        """(sample rows, batched env per branch) per transformer call. Samples are grouped by the
        shapes of their env tensors (e.g. prompt token lengths), so every call sees exactly the env a
        trainer replays with, unpadded, and then cut to at most max_batch_size samples."""

        def shapes(p: int) -> tuple:
            return tuple(
                (branch, key, tuple(value.shape))
                for branch, per_prompt in conditioning.envs.items()
                for key, value in per_prompt[p].items()
                if isinstance(value, torch.Tensor)
            )

        groups: dict[tuple, list[int]] = {}
        for k, p in enumerate(prompt_indices):
            groups.setdefault(shapes(p), []).append(k)
        batches = []
        for members in groups.values():
            for start in range(0, len(members), self.max_batch_size):
                rows = members[start : start + self.max_batch_size]
                envs = {
                    branch: stack_envs(
                        [per_prompt[prompt_indices[k]] for k in rows], conditioning.batched_keys
                    )
                    for branch, per_prompt in conditioning.envs.items()
                }
                batches.append((torch.tensor(rows, device=self.adapter.device), envs))
        return batches

    def _velocity_fn(self, batches: list[tuple], timesteps: torch.Tensor, rule: str, scale: float):
        """velocity(x, i): the transformer on every micro-batch and branch, guidance applied."""
        adapter = self.adapter

        def velocity(x: torch.Tensor, i: int) -> torch.Tensor:
            t = timesteps[i].item()
            v = torch.empty_like(x)
            for rows, envs in batches:
                self.metrics.forwards(len(rows), len(envs))
                per_branch = {
                    branch: call_transformer(
                        adapter.transformer, x[rows], t, env, adapter.dtype, adapter.timestep_divisor
                    )
                    for branch, env in envs.items()
                }
                v[rows] = apply_guidance(rule, scale, per_branch)
            return v

        return velocity

    @torch.inference_mode()
    def prepare(self, request: rollout_pb2.RolloutRequest) -> "PreparedRollout":
        """Encode the prompts and set up the schedule, the plan and the velocity for ``request``."""
        adapter = self.adapter
        group = request.samples_per_prompt
        prompt_indices = [k // group for k in range(len(request.prompts) * group)]
        cfg_scale = getattr(request, adapter.cfg_scale_field)
        cfg = cfg_scale > 1.0
        rule = adapter.cfg_rule if cfg else "none"
        encoded = self.prompt_cache.encode(
            list(request.prompts),
            request.negative_prompt if cfg else None,
            request.guidance_scale,
            request.height,
            request.width,
        )
        conditioning = encoded.conditioning
        sigmas, timesteps = adapter.schedule(request.num_steps, request.height, request.width)
        sampler_type = steps.SAMPLERS_BY_ENUM[request.sampler].name
        stochastic = stochastic_steps(
            sampler_type, sigmas, request.noise_level, list(request.stochastic_steps)
        )
        latent_shape = adapter.latent_shape(request.height, request.width)
        self.parallel.check_splittable(adapter.transformer, latent_shape, conditioning.envs)
        batches = self._micro_batches(prompt_indices, conditioning)
        velocity = self._velocity_fn(batches, timesteps, rule, cfg_scale)
        plan = SamplerPlan(
            sampler_type=sampler_type,
            sigmas=sigmas,
            stochastic=stochastic,
            noise_level=request.noise_level,
            log_prob_constants=request.log_prob_constants,
            latent_dtype=dtypes.LATENT[request.latent_dtype],
            seeds=list(request.seeds),
            latent_shape=latent_shape,
            device=adapter.device,
        )
        env_tensors, env_json = env_payload(conditioning.envs)
        started = rollout_pb2.RolloutStarted(
            resolved=request,
            seeds=request.seeds,
            prompt_indices=prompt_indices,
            sigmas=sigmas.tolist(),
            timesteps=timesteps.tolist(),
            stochastic=stochastic,
            log_prob_constants=request.log_prob_constants,
            layout=rollout_pb2.LatentLayout(
                shape=latent_shape,
                packing=adapter.latent_packing(),
                height=request.height,
                width=request.width,
            ),
            transformer_call=rollout_pb2.TransformerCall(
                transformer_class=type(adapter.transformer).__name__,
                model_dtype=dtypes.NAMES[adapter.dtype],
                timestep_divisor=adapter.timestep_divisor,
                timestep_rule=adapter.timestep_rule,
                guidance_rule=rule,
                guidance_rule_scale=cfg_scale,
                branches=list(conditioning.envs),
                batched_env_keys=conditioning.batched_keys,
            ),
            model=self.model_name,
            family=adapter.family,
            policy_version=self.policy_version,
            sp_degree=self.parallel.degree,
            attention_split=self.parallel.attention_split,
            env_json=env_json,
            noise_rule=noise.NOISE_RULE,
        )
        return PreparedRollout(plan, velocity, started, env_tensors, encoded.hits, encoded.misses)

    @torch.inference_mode()
    def execute(
        self,
        request: rollout_pb2.RolloutRequest,
        emit: Callable,
        cancelled: Callable[[], bool],
        admitted_at: float,
    ) -> None:
        """Run one resolved request on the worker thread, emitting its whole stream (rank 0 only)."""
        started_at = time.perf_counter()
        prepared = self.prepare(request)
        encoded_at = time.perf_counter()
        self.metrics.prompt_cache(prepared.prompt_cache_hits, prepared.prompts_encoded)
        if not self.parallel.is_leader:
            sample(prepared.plan, prepared.velocity, SamplerHooks(), cancelled)
            return
        encoder = StreamEncoder(
            request=request,
            started=prepared.started,
            env_tensors=prepared.env_tensors,
            sent=latents_sent(request.latents, prepared.plan.stochastic),
            emit=self.metrics.counting(emit),
            max_message_bytes=self.max_message_bytes,
        )
        final = sample(prepared.plan, prepared.velocity, self.metrics.timing(encoder), cancelled)
        denoised_at = time.perf_counter()

        if request.images:
            for k, image in enumerate(self.adapter.decode(final, request.height, request.width)):
                encoder.on_image(k, image)
        finished_at = time.perf_counter()
        encoder.on_finish(
            rollout_pb2.RolloutFinished(
                encode_seconds=encoded_at - started_at,
                denoise_seconds=denoised_at - encoded_at,
                decode_seconds=finished_at - denoised_at,
                total_seconds=finished_at - admitted_at,
                queue_seconds=started_at - admitted_at,
                peak_memory_bytes=peak_memory_bytes(self.adapter.device),
                prompt_cache_hits=prepared.prompt_cache_hits,
                prompts_encoded=prepared.prompts_encoded,
            )
        )


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
