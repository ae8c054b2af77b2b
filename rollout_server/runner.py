"""The model side of the engine: a request's conditioning and plan, and one batched velocity per round.

Rows: every live sample of a rollout (a tree rollout's node that owns the current latent) has one
transformer row per env branch (``positive``, and ``negative`` with true CFG). A tree rollout forks
after the forward of a branch step: each node's row becomes one row per child, and prunes drop rows
before a step (``Rollout.fork``, ``Rollout.prune``). Rows of any rollouts run in the same forward
when they are compatible: the same transformer at their current steps (Wan 2.2's two experts run
apart), the same latent shape and the same env signature (the shapes of the batched env tensors, and
equal shared entries such as Flux's ``txt_ids``; the model dtype is the server's one). They may sit
at different steps, with different schedules, samplers, noise levels, guidance and CFG scales: each
row is fed its own timestep. A compatible group is cut into the fewest forwards of at most
``max_batch_size`` rows and at most ``max_latent_elements`` latent elements (the largest admitted
row, so no forward takes longer than one row at the largest admitted shape), of even sizes. Each
rollout's branches are then combined by its own guidance rule in float32, and the step math runs per
rollout (``sampler.advance``): a row's numbers depend on its neighbours in a forward only through
the model's float rounding at another batch size.

The runner is all that the other sequence-parallel ranks run: given the same rollouts in the same
order, every rank forms the same forwards.
"""

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rollout.v1 import rollout_pb2
from rollout_core import dtypes, solvers, steps
from rollout_core.transformer_call import CallForm, apply_guidance, call_transformer, stack_envs
from rollout_core.tree import Tree
from rollout_server.errors import InvalidRequest
from rollout_server.families.base import FamilyAdapter, MediaShape, Sound
from rollout_server.prompt_cache import Conditioning, PromptCache
from rollout_server.sampler import SamplerPlan, SamplerState, init, regroup, stochastic_steps
from rollout_server.validation import check_prompt_tokens, initial_latents, step_noise_levels

if TYPE_CHECKING:
    from rollout_server.images import ConditionImage
    from rollout_server.limits import Limits
    from rollout_server.metrics import ServerMetrics
    from rollout_server.parallel import SequenceParallel


@dataclass(frozen=True)
class Row:
    """One transformer row: row ``sample`` of a rollout's latents, the node ``node``, in env branch
    ``branch``."""

    sample: int
    node: int
    branch: str
    env: dict[str, Any]  # batched entries with a leading dimension of 1
    signature: tuple  # rows with equal latent shape and signature may share a forward


@dataclass(eq=False)
class Rollout:
    """A request made ready to sample, and where its sampler stands."""

    key: int  # the engine's id for it, the same on every rank
    request: rollout_pb2.RolloutRequest  # resolved
    plan: SamplerPlan
    call_form: CallForm  # the family's, with the request's latent streams
    state: SamplerState
    timesteps: torch.Tensor  # float32 [T + 1], as fed (before the family's divisor)
    experts: list[str]  # [T]: the transformer (pipeline component) each step runs
    guidance_rule: str
    cfg_scales: list[float]  # [T]: the scale of the guidance rule at each step (its expert's)
    conditioning: Conditioning
    prompt_indices: list[int]
    tree: Tree  # a flat rollout's has its samples as roots only
    envs: dict[tuple[str, int], tuple[dict[str, Any], tuple]]  # (branch, prompt) -> env, signature
    prompt_cache_hits: int  # distinct texts whose conditioning came from the prompt cache
    prompts_encoded: int  # distinct texts encoded for this rollout
    condition_images: list[rollout_pb2.ConditionImageInfo]  # per prompt, for image-conditioned families
    stream: Any = None  # rank 0: what its events become (engine.RolloutEvents)
    pieces: Iterator | None = None  # rank 0, once its steps are done: its decode, a piece at a time
    shared_steps: int = 0  # steps whose forwards carried other rollouts' rows too
    transformer_rows: int = 0  # rows of the forwards it took
    times: dict[str, float] = field(default_factory=dict)  # perf_counter stamps, for the timings
    live: list[int] = field(default_factory=list)  # the node of each row of the latents
    rows: list[Row] = field(default_factory=list)
    pruned: set[int] = field(default_factory=set)  # nodes stopped by a prune, and those below them

    def __post_init__(self):
        self._set_rows([root.id for root in self.tree.roots])

    @property
    def done(self) -> bool:
        return self.state.step == self.plan.num_steps or not self.live

    def _set_rows(self, nodes: list[int]) -> None:
        self.live = nodes
        self.rows = [
            Row(b, node, branch, *self.envs[branch, self.tree[node].prompt_index])
            for branch in self.conditioning.envs
            for b, node in enumerate(nodes)
        ]

    def _regroup(self, rows: list[int], nodes: list[int]) -> None:
        regroup(self.state, rows, [self.tree[node].seed for node in nodes])
        self._set_rows(nodes)

    def fork(self, v: torch.Tensor) -> torch.Tensor:
        """After the forward of step i: at a branch step, each row becomes one row per child that is
        not pruned (the velocity copied with it); returns the velocity of the rows now."""
        if self.state.step not in self.tree.branch_steps:
            return v
        pairs = [
            (b, child)
            for b, node in enumerate(self.live)
            for child in self.tree[node].children
            if child not in self.pruned
        ]
        rows = [b for b, _ in pairs]
        self._regroup(rows, [child for _, child in pairs])
        return v[torch.tensor(rows, dtype=torch.long, device=v.device)]

    def prune(self, nodes: list[int]) -> list[int]:
        """Stop ``nodes`` from the next step on, with what ``Tree.pruned_by`` adds: their rows leave,
        and they fork no children. Returns the nodes newly pruned, in id order."""
        newly = self.tree.pruned_by(nodes, self.pruned) - self.pruned
        self.pruned |= newly
        kept = [(b, node) for b, node in enumerate(self.live) if node not in self.pruned]
        if len(kept) < len(self.live):
            self._regroup([b for b, _ in kept], [node for _, node in kept])
        return sorted(newly)


@dataclass(frozen=True)
class Velocities:
    """One round's forwards, by rollout key."""

    guided: dict[int, torch.Tensor]  # the velocity after guidance, float32 [B, ...]
    failures: dict[int, Exception]  # rollouts whose forward raised
    shared: set[int]  # rollouts whose rows shared a forward with another rollout's
    cancelled: set[int]  # dropped rollouts whose forwards were skipped: they take no step


def env_signature(env: dict[str, Any], batched_keys: tuple[str, ...]) -> tuple:
    """What must match for two rows' envs to be stacked: the shapes of the batched tensors, and the
    values of the shared entries (``stack_envs`` takes those from the first row)."""
    signature = []
    for key, value in sorted(env.items()):
        if isinstance(value, torch.Tensor):
            if key in batched_keys:
                signature.append((key, value.dtype, tuple(value.shape)))
            else:
                digest = hashlib.sha256(value.detach().cpu().contiguous().view(torch.uint8).numpy())
                signature.append((key, value.dtype, tuple(value.shape), digest.hexdigest()))
        elif key in batched_keys and value is not None:
            signature.append((key, "list", len(value)))
        else:
            signature.append((key, repr(value)))
    return tuple(signature)


def tree_of(request: rollout_pb2.RolloutRequest) -> Tree:
    """The tree of a resolved request (a flat one's: its samples as roots)."""
    group = request.samples_per_prompt
    prompt_indices = [k // group for k in range(len(request.seeds))]
    branches = [(branch.step, branch.factor) for branch in request.branches]
    return Tree.grow(request.seeds, prompt_indices, branches, request.num_steps)


class Runner:
    """Prompt encoding, schedules and batched transformer forwards on the loaded model."""

    def __init__(
        self,
        adapter: FamilyAdapter,
        parallel: "SequenceParallel",
        limits: "Limits",
        prompt_cache_entries: int,
        metrics: "ServerMetrics",
    ):
        self.adapter = adapter
        self.parallel = parallel
        # A forward takes at most max_batch_size rows, and the elements of one row at the largest
        # admitted shape.
        self.limits = limits
        self.metrics = metrics
        # Used by the worker only, and on every rank alike: each sees the same requests in order.
        self.prompt_cache = PromptCache(adapter, prompt_cache_entries)
        # Stacked envs of the last round's forwards: reused while the same rows share a forward.
        self._stacked: dict[tuple, dict[str, Any]] = {}

    @torch.inference_mode()
    def prepare(
        self, key: int, request: rollout_pb2.RolloutRequest, condition_images: list["ConditionImage"] = ()
    ) -> Rollout:
        """Encode the prompts and their conditioning images (decoded at admission: the worker never
        decodes a file) through the prompt cache, and set up the schedule, plan and x_0.
        InvalidRequest if the sequence-parallel split cannot take the prompts' token lengths."""
        adapter = self.adapter
        group = request.samples_per_prompt
        prompt_indices = [k // group for k in range(len(request.prompts) * group)]
        cfg = adapter.runs_cfg(request)
        shape = MediaShape.of(request)
        negative_prompt = request.negative_prompt if cfg else None
        encoded = self.prompt_cache.encode(
            list(request.prompts), negative_prompt, request.guidance_scale, shape, condition_images
        )
        conditioning = encoded.conditioning
        if request.sigmas:
            sigmas, timesteps = adapter.trainer_schedule(list(request.sigmas))
        else:
            sigmas, timesteps = adapter.schedule(request.num_steps, shape)
        sampler_type = steps.SAMPLERS_BY_ENUM[request.sampler].name
        latent_shape = adapter.latent_shape(shape)
        call_form = adapter.call_form_for(shape)
        check_prompt_tokens(self.parallel.dims, adapter, conditioning.envs)
        noise_levels = step_noise_levels(request)
        stochastic = stochastic_steps(sampler_type, sigmas, noise_levels, list(request.stochastic_steps))
        if forks_in_vain := [
            f"branches[{k}].step"
            for k, branch in enumerate(request.branches)
            if branch.factor > 1 and not stochastic[branch.step]
        ]:
            # ODE, a step left out of stochastic_steps, a zero noise level, or CPS into sigma = 0.
            raise InvalidRequest(
                [(name, "the step draws no noise: its children would be equal") for name in forks_in_vain]
            )
        plan = SamplerPlan(
            sampler_type=sampler_type,
            sigmas=sigmas,
            stochastic=stochastic,
            solver=solvers.SOLVERS_BY_ENUM[request.solver].name,
            noise_levels=noise_levels,
            log_prob_constants=request.log_prob_constants,
            latent_dtype=dtypes.LATENT[request.latent_dtype],
            seeds=list(request.seeds),
            latent_shape=latent_shape,
            device=adapter.device,
            initial=initial_latents(request.initial_latents) if request.initial_latents else None,
            latent_streams=call_form.streams,
        )
        signatures: dict[int, tuple] = {}  # equal texts share one env dict: sign it once
        envs = {}
        for branch, per_prompt in conditioning.envs.items():
            for p, env in enumerate(per_prompt):
                if id(env) not in signatures:
                    signatures[id(env)] = env_signature(env, conditioning.batched_keys)
                envs[branch, p] = (env, signatures[id(env)])
        boundary_ratio = request.boundary_ratio if request.HasField("boundary_ratio") else None
        experts = [adapter.expert_for(t, boundary_ratio) for t in timesteps[:-1].tolist()]
        return Rollout(
            key=key,
            request=request,
            plan=plan,
            call_form=call_form,
            state=init(plan),
            timesteps=timesteps,
            experts=experts,
            guidance_rule=adapter.cfg_rule if cfg else "none",
            cfg_scales=[adapter.cfg_scale_for(request, expert) for expert in experts],
            conditioning=conditioning,
            prompt_indices=prompt_indices,
            tree=tree_of(request),
            envs=envs,
            prompt_cache_hits=encoded.hits,
            prompts_encoded=encoded.misses,
            condition_images=[image.info for image in condition_images],
        )

    @torch.inference_mode()
    def velocities(self, rollouts: list[Rollout], dropped: Callable[[int], bool]) -> Velocities:
        """The guided velocity of each rollout's current latent. A single-rank server fails only the
        rollouts with rows in a forward that raised; under sequence parallelism the error
        propagates, since the ranks are out of step. Before each forward, a forward whose rollouts
        have all been ``dropped`` (by key; rank 0 decides for every rank) is skipped, so a cancel
        waits for one forward at most, not the whole round."""
        groups: dict[tuple, list[tuple[Rollout, Row]]] = {}
        for rollout in rollouts:
            for row in rollout.rows:
                expert = rollout.experts[rollout.state.step]
                # Several latent streams: equal joint sizes may cut into different streams.
                key = (expert, tuple(rollout.plan.latent_shape), rollout.call_form, row.signature)
                groups.setdefault(key, []).append((rollout, row))
        per_branch: dict[int, dict[str, torch.Tensor]] = {
            r.key: {branch: torch.empty_like(r.state.x) for branch in r.conditioning.envs} for r in rollouts
        }
        failures: dict[int, Exception] = {}
        shared: set[int] = set()
        cancelled: set[int] = set()
        stacked: dict[tuple, dict[str, Any]] = {}
        for (expert, latent_shape, _, _), members in groups.items():
            # The fewest forwards of at most max_batch_size rows, of even sizes (9 rows at 8: 5 + 4),
            # large rows fewer at a time.
            row_elements = math.prod(latent_shape)
            rows_per_forward = self.limits.rows_per_forward(row_elements)
            forwards = -(-len(members) // rows_per_forward)
            size = -(-len(members) // forwards)
            for start in range(0, len(members), size):
                batch = [(r, row) for r, row in members[start : start + size] if r.key not in failures]
                if not batch:
                    continue
                keys = {r.key for r, _ in batch}
                if self.parallel.leader_decides(all(dropped(key) for key in keys)):
                    cancelled.update(keys)
                    continue
                try:
                    v = self._forward(expert, batch, stacked)
                except Exception as error:
                    if self.parallel.enabled:
                        raise
                    for r, _ in batch:
                        failures.setdefault(r.key, error)
                    continue
                for j, (r, row) in enumerate(batch):
                    per_branch[r.key][row.branch][row.sample] = v[j]
                if len(keys) > 1:
                    shared.update(keys)
        self._stacked = stacked
        guided = {
            r.key: apply_guidance(r.guidance_rule, r.cfg_scales[r.state.step], per_branch[r.key])
            for r in rollouts
            if r.key not in failures and r.key not in cancelled
        }
        return Velocities(guided, failures, shared, cancelled)

    def _forward(self, expert: str, batch: list[tuple[Rollout, Row]], stacked: dict) -> torch.Tensor:
        """One call of the transformer ``expert`` on ``batch``'s rows, each at its rollout's current
        step."""
        adapter = self.adapter
        members = tuple((r.key, row.node, row.branch) for r, row in batch)
        env = self._stacked.get(members)
        if env is None:
            env = stack_envs([row.env for _, row in batch], adapter.batched_env_keys)
        stacked[members] = env
        x = torch.cat([r.state.x[row.sample : row.sample + 1] for r, row in batch])
        timesteps = torch.stack([r.timesteps[r.state.step] for r, _ in batch])
        self.metrics.forward(len(batch))
        return call_transformer(
            adapter.experts[expert],
            x,
            timesteps,
            env,
            adapter.dtype,
            adapter.timestep_divisor,
            adapter.conditioning,
            batch[0][0].call_form,
            adapter.batched_env_keys,
        )

    @torch.inference_mode()
    def decode_pieces(
        self, latents: torch.Tensor, shape: MediaShape
    ) -> Iterator[tuple[int, int, list] | tuple[int, Sound]]:
        """Final latents [B, ...] decoded a piece at a time, sample by sample: (sample, index of the
        piece's first frame, its frames), then, for a family that generates sound, (sample, its
        Sound). A piece is what the adapter decodes at once: one image, one chunk of a video's
        frames, or a sample's sound."""
        for k in range(latents.shape[0]):
            first = 0
            for frames in self.adapter.decode_frames(latents[k : k + 1], shape):
                yield k, first, frames
                first += len(frames)
            if self.adapter.decodes_audio:
                yield k, self.adapter.decode_audio(latents[k : k + 1], shape)
