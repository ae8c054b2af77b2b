"""The model-agnostic, step-wise sampler: noise, fp32 step, log-prob, solver history.

``init(plan)`` gives a rollout's state at x_0, and ``advance(plan, state, v)`` takes its next step
with a velocity computed elsewhere (the runner's batched transformer call with guidance) and says
what happened in a ``StepRecord``. A state's rows are its live samples, each with the seed its noise
comes from, and the deterministic solver's history (``rollout_core.solvers.History``: the data
predictions of the last steps, UniPC's corrected sample): ``regroup`` re-forms them together, for a
tree rollout's forks (a row repeated once per child, with the children's seeds and its history)
and prunes (rows dropped). Only the plan and the state enter a step, so the engine
may step many rollouts, each at its own step, in any interleaving, and every sequence-parallel rank,
stepping the same gathered velocity, holds the same history. The sampler owns the noise
(``rollout_core.noise``), the stochastic step math (``rollout_core.steps``) and the deterministic
solvers (``rollout_core.solvers``), and knows no model. A stochastic step is a first-order Gaussian
transition from x_i as streamed, and ends the solver's history; every other step is the plan's
solver's.

A sample with several latent streams (LTX-2's video and audio) is stepped as its joint latent
(``rollout_core.latent_streams``): its noise is the joint draw, its log-prob the mean over every
element of every stream, and each stream's own log-prob is recorded beside it.

The streamed log-prob scores exactly the streamed x_{i+1}: when latents are kept in float32,
x_{i+1} = mean + sd * eps and the residual is sd * eps, computed from the full noise tensor; when the
latent dtype is bf16/fp16 the state is rounded after every step and the residual is
round(x_{i+1}) - mean, the bytes the trainer will score.

A step that is not finite fails its rollout, naming the step and the sample, and says whose
failure it is. The request's (``InvalidRequest`` naming the field): a latent that the step
coefficients carried beyond LATENT_RANGE in magnitude (the bound on a trainer's x_0) while every
velocity stayed within it, since then only the noise level or the schedule amplified it; or a latent
that overflows only once rounded to the latent dtype (float16 tops out at 65504). Otherwise the
model's (``NonFiniteStep``, INTERNAL): a velocity that is not finite for a latent in range, or
velocities that sent the latent out of range.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout_core import dtypes, noise, solvers, steps
from rollout_server.errors import InvalidRequest, NonFiniteStep

if TYPE_CHECKING:
    from rollout_core.latent_streams import LatentStream

# The largest magnitude of a latent's elements that the server admits (a trainer's x_0) and holds a
# model to. A flow-matching x_0 is standard normal noise, or noise mixed with a normalised data latent
# of about unit scale: no normal draw comes near it (P(|z| > 10) is about 1.5e-23), and normalised VAE
# latents stay within tens. It is 2^6 below float16's largest value, 65504 (float16 is a latent dtype
# and a model dtype), which leaves that factor for a step's moves and for the sums of a first layer.
LATENT_RANGE = 1024.0


@dataclass(frozen=True)
class SamplerPlan:
    """Everything the loop needs besides the model."""

    sampler_type: str
    sigmas: torch.Tensor  # float32 [T + 1], terminal 0 included
    stochastic: Sequence[bool]  # [T]: the step draws noise and is scored
    solver: str  # the deterministic solver of the other steps (rollout_core.solvers.SOLVERS)
    noise_levels: Sequence[float]  # [T]: the noise level of each step
    log_prob_constants: bool
    latent_dtype: torch.dtype  # the sampler state is rounded to it after every step
    seeds: Sequence[int]  # the rows' seeds at x_0
    latent_shape: Sequence[int]  # one sample's latent as the transformer consumes it
    device: torch.device
    initial: torch.Tensor | None = None  # a trainer's x_0 [B, ...] (float32), else the seeds'
    # Several latent streams per sample (LTX-2), whose joint latent latent_shape is; empty for one.
    latent_streams: tuple["LatentStream", ...] = ()

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1

    @property
    def step_orders(self) -> list[int]:
        """[T]: the order of each step (1 on a stochastic step)."""
        return solvers.step_orders(self.solver, list(self.stochastic))


@dataclass(frozen=True)
class StepRecord:
    """What step i did (tensors on the sampler's device, float32)."""

    index: int
    stochastic: bool
    order: int  # of the step's rule: 1 for a stochastic step
    x_next: torch.Tensor
    log_probs: torch.Tensor | None  # [B] when stochastic
    stream_log_probs: dict[str, torch.Tensor]  # each latent stream's own [B], when there are several
    sd: torch.Tensor  # 0-d; 0 when not stochastic
    eps: torch.Tensor | None
    mean: torch.Tensor
    velocity: torch.Tensor


def stochastic_steps(
    sampler_type: str, sigmas: torch.Tensor, noise_levels: Sequence[float], requested
) -> list[bool]:
    """Which steps draw noise: the requested ones (all when ``requested`` is empty) whose sd > 0."""
    num_steps = len(sigmas) - 1
    chosen = set(requested) if requested else set(range(num_steps))
    return [
        i in chosen and steps.noise_std(sampler_type, sigmas, i, noise_levels[i]).item() > 0
        for i in range(num_steps)
    ]


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if dtype == torch.float32 else x.to(dtype).float()


@dataclass
class SamplerState:
    """Where one rollout stands: ``x`` is x_i [B, ...], the latent that step ``step`` = i denoises,
    row b draws its noise from ``seeds[b]``, and ``history`` holds its solver's rows.
    ``velocities_in_range``: every velocity so far was within LATENT_RANGE in magnitude, so a latent
    beyond it was carried there by the step coefficients, not by the model."""

    x: torch.Tensor
    seeds: list[int]
    step: int = 0
    history: solvers.History = solvers.History()
    velocities_in_range: bool = True


def init(plan: SamplerPlan) -> SamplerState:
    """x_0 from the per-sample seeds (or the plan's own), rounded to the latent dtype, on the plan's
    device."""
    x0 = plan.initial
    if x0 is None:
        x0 = noise.initial_noise(plan.seeds, plan.latent_shape, plan.latent_streams)
    x0 = _round(x0, plan.latent_dtype).to(plan.device)
    return SamplerState(x0, list(plan.seeds))


def regroup(state: SamplerState, rows: Sequence[int], seeds: Sequence[int]) -> None:
    """Re-form the state's rows before its step: new row b is old row ``rows[b]``, drawing its noise
    from ``seeds[b]`` from this step on (a row listed twice is copied bitwise, with its history)."""
    index = torch.tensor(rows, dtype=torch.long, device=state.x.device)
    state.x = state.x[index]
    state.history = state.history.rows(index)
    state.seeds = list(seeds)


def _transition(
    plan: SamplerPlan, i: int, x: torch.Tensor, v: torch.Tensor, history: solvers.History
) -> tuple[torch.Tensor, torch.Tensor, solvers.History, int]:
    """Step i's mean and noise std, the solver history after it and its order: the sampler's
    Gaussian transition on a stochastic step (which ends the history), else the plan's solver."""
    if plan.stochastic[i]:
        level = plan.noise_levels[i]
        mean = steps.transition_mean(plan.sampler_type, x, v, plan.sigmas, i, level)
        return mean, steps.noise_std(plan.sampler_type, plan.sigmas, i, level), solvers.History(), 1
    solved = solvers.solver_step(plan.solver, x, v, plan.sigmas, i, history)
    return solved.x_next, torch.zeros(()), solved.history, solved.order


def advance(plan: SamplerPlan, state: SamplerState, v: torch.Tensor) -> StepRecord:
    """Take step i = ``state.step`` with the velocity ``v`` of ``state.x`` (after guidance): ``state``
    moves on to x_{i+1}, and the record says what happened. NonFiniteStep or InvalidRequest (see the
    module's docstring for which) if v or x_{i+1} is not finite. Only the plan and the state enter,
    so rollouts advance independently of one another."""
    i, x = state.step, state.x
    velocity_peak = v.abs().amax().item()  # NaN if any element is
    if not math.isfinite(velocity_peak):
        raise _not_finite(plan, state, "velocity", v)
    state.velocities_in_range &= velocity_peak <= LATENT_RANGE
    stochastic = plan.stochastic[i]
    mean, sd, history, order = _transition(plan, i, x, v, state.history)
    eps = log_probs = None
    per_stream = {}
    if stochastic:
        eps = noise.step_noise(state.seeds, i, plan.latent_shape, plan.latent_streams).to(plan.device)
        scaled_noise = sd.to(plan.device) * eps
        unrounded = mean + scaled_noise
        x_next = _round(unrounded, plan.latent_dtype)
        residual = scaled_noise if plan.latent_dtype == torch.float32 else x_next - mean
        log_probs = steps.log_prob(residual, sd, plan.log_prob_constants)
        if plan.latent_streams:
            per_stream = steps.stream_log_probs(residual, sd, plan.log_prob_constants, plan.latent_streams)
    else:
        unrounded = mean
        x_next = _round(mean, plan.latent_dtype)
    if not torch.isfinite(x_next).all():
        raise _not_finite(plan, state, "next latent", x_next, unrounded)
    state.x, state.step, state.history = x_next, i + 1, history
    return StepRecord(i, stochastic, order, x_next, log_probs, per_stream, sd, eps, mean, v)


def _not_finite(
    plan: SamplerPlan,
    state: SamplerState,
    what: str,
    tensor: torch.Tensor,
    unrounded: torch.Tensor | None = None,
) -> Exception:
    """The failure of step ``state.step``, whose ``what`` ``tensor`` [B, ...] is not finite (the next
    latent's value before its rounding to the latent dtype: ``unrounded``), named at its first bad
    sample: the request's (InvalidRequest naming the field) or the model's (NonFiniteStep), as the
    module's docstring says."""
    i = state.step
    rows = (~torch.isfinite(tensor.flatten(1))).any(dim=1).nonzero().flatten().tolist()
    b = rows[0]
    where = f"step {i}: the {what} of sample {b} is not finite ({len(rows)} samples)"
    if unrounded is not None and torch.isfinite(unrounded[b]).all():
        name, largest = dtypes.NAMES[plan.latent_dtype], torch.finfo(plan.latent_dtype).max
        return InvalidRequest([("latent_dtype", f"{where}: it is beyond {name}'s largest, {largest:g}")])
    peak = state.x[b].abs().amax().item()
    if peak > LATENT_RANGE and state.velocities_in_range:
        # Only the coefficients of the steps before can have carried it there: the stochastic steps'
        # grow with the noise level, the deterministic solvers' with an uneven schedule.
        field = "noise_level" if any(plan.stochastic[:i]) else "sigmas"
        return InvalidRequest(
            [
                (
                    field,
                    f"{where}: the steps carried its latent to {peak:.3g} in magnitude, beyond "
                    f"{LATENT_RANGE:g}, while every velocity stayed within {LATENT_RANGE:g}: lower the "
                    "noise level, or take a schedule that keeps the latent in range",
                )
            ]
        )
    return NonFiniteStep(where)


def unstable_step(
    sampler_type: str,
    solver: str,
    sigmas: torch.Tensor,
    noise_levels: Sequence[float],
    requested: Sequence[int],
) -> int | None:
    """The first step of a schedule (float32 ``sigmas``) whose coefficients, or noise std, are not
    finite in float32 for the sampler, its noise levels, the ``requested`` stochastic steps and the
    deterministic ``solver``; None when every step's are. Each step is taken as a rollout takes it,
    on one latent element: from x = 1 with v = 0 (its coefficient on the latent) and from x = 0 with
    v = 1 (on the velocity), with the solver's history as those steps make it. T small steps."""
    stochastic = stochastic_steps(sampler_type, sigmas, noise_levels, requested)
    probe = SamplerPlan(
        sampler_type=sampler_type,
        sigmas=sigmas,
        stochastic=stochastic,
        solver=solver,
        noise_levels=noise_levels,
        log_prob_constants=False,  # no log-prob is taken, nor noise drawn: seeds and dtype unused
        latent_dtype=torch.float32,
        seeds=(),
        latent_shape=(1,),
        device=torch.device("cpu"),
    )
    x, v = torch.tensor([[1.0], [0.0]]), torch.tensor([[0.0], [1.0]])
    history = solvers.History()
    for i in range(probe.num_steps):
        mean, sd, history, _ = _transition(probe, i, x, v, history)
        if not (torch.isfinite(mean).all() and torch.isfinite(sd)):
            return i
    return None
