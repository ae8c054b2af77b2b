"""How a request steps: its number of steps or a trainer's schedule (sigmas), the sampler and its noise
level, the deterministic solver, the stochastic steps, and the probe of a trainer's schedule for
coefficients that are not finite."""

import math
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_core import solvers, steps
from rollout_server.sampler import unstable_step
from rollout_server.validation.context import Problems, ServingContext, finite_in

if TYPE_CHECKING:
    from rollout_server.limits import Limits

# Smallest positive noise level: below it sd is lost in the float32 rounding of the latents, so a
# 'stochastic' step would be deterministic in all but name.
MIN_NOISE_LEVEL = 1e-6
# Smallest sigma of a trainer's schedule but its final 0: float32's smallest normal number, 2^-126. The
# steps divide by sigma (the SDE means by 2 sigma, the solvers' ratios and log-SNRs), which overflows
# or loses its precision on a subnormal one.
MIN_SIGMA = torch.finfo(torch.float32).tiny
# The fields a trainer's schedule is probed with (``sampler.unstable_step``): checked once these are valid.
STEP_FIELDS = {"sigmas", "num_steps", "sampler", "noise_level", "solver", "stochastic_steps", "branches"}


def step_count_problems(
    request: rollout_pb2.RolloutRequest, resolved: rollout_pb2.RolloutRequest, context: ServingContext
) -> Problems:
    """A trainer's sigmas (they set num_steps), and num_steps within the model's and the server's
    bounds."""
    bad: Problems = []
    min_steps = context.model.min_steps
    if request.sigmas:
        min_steps = 1  # the family's schedule has a minimum, a given one does not
        schedule_problem = _sigmas_problem(request, context.limits)
        if schedule_problem:
            bad.append(("sigmas", schedule_problem))
        else:
            resolved.num_steps = len(request.sigmas) - 1
            resolved.sigmas.extend(request.sigmas)
    num_steps, max_steps = resolved.num_steps, context.limits.max_steps
    if not min_steps <= num_steps <= max_steps:
        bad.append(("num_steps", f"must be in [{min_steps}, {max_steps}], got {num_steps}"))
    return bad


def _sigmas_problem(request: rollout_pb2.RolloutRequest, limits: "Limits") -> str:
    """What is wrong with a trainer's schedule, or "": T + 1 values for T in [1, max_steps] (counted
    before any is read) and num_steps if set, finite, strictly decreasing, in (0, 1] but the last 0."""
    count = len(request.sigmas)
    if not 2 <= count <= limits.max_steps + 1:
        return f"{count} values: a schedule of T steps has T + 1, T in [1, {limits.max_steps}]"
    if request.HasField("num_steps") and request.num_steps != count - 1:
        return f"{count} values for num_steps {request.num_steps}: num_steps + 1 are needed"
    sigmas = list(request.sigmas)
    if not all(math.isfinite(s) for s in sigmas):
        return "every value must be finite"
    if sigmas[-1] != 0:
        return f"the last value must be 0, got {sigmas[-1]}"
    if not all(MIN_SIGMA <= s <= 1 for s in sigmas[:-1]):
        return (
            f"every value but the last must be in [{MIN_SIGMA:.9g}, 1] (float32's smallest normal number: "
            "the steps divide by sigma)"
        )
    if any(b >= a for a, b in zip(sigmas, sigmas[1:], strict=False)):
        return "the values must be strictly decreasing"
    return ""


def sampler_problems(request: rollout_pb2.RolloutRequest, resolved: rollout_pb2.RolloutRequest) -> Problems:
    """The sampler and its noise level, the solver, and the stochastic steps (taken into ``resolved``);
    ``resolved`` gets the sampler's log-prob constants unless the request sets them."""
    bad: Problems = []
    # An unset sampler or solver (0) is not merged over the defaults: they stay the served ones.
    sampler = steps.SAMPLERS_BY_ENUM.get(resolved.sampler)
    if sampler is None:
        bad.append(("sampler", f"unknown sampler type {request.sampler}"))
    elif not finite_in(resolved.noise_level, 0.0, sampler.max_noise_level):
        bad.append(
            (
                "noise_level",
                f"must be in [0, {sampler.max_noise_level}] for {sampler.name}, got {resolved.noise_level}",
            )
        )
    elif 0.0 < resolved.noise_level < MIN_NOISE_LEVEL:
        bad.append(("noise_level", f"must be 0 or at least {MIN_NOISE_LEVEL}, got {resolved.noise_level}"))
    if resolved.solver not in solvers.SOLVERS_BY_ENUM:
        bad.append(("solver", f"unknown solver {request.solver}; expected one of {list(solvers.SOLVERS)}"))

    chosen, num_steps = list(request.stochastic_steps), resolved.num_steps
    if chosen:
        if sampler is not None and not sampler.stochastic:
            bad.append(("stochastic_steps", f"the {sampler.name} sampler has no stochastic steps"))
        elif any(i >= num_steps for i in chosen):
            bad.append(("stochastic_steps", f"indices must be < num_steps ({num_steps})"))
        elif any(b <= a for a, b in zip(chosen, chosen[1:], strict=False)):
            bad.append(("stochastic_steps", "indices must be strictly increasing"))
        resolved.stochastic_steps.extend(chosen)
    if not request.HasField("log_prob_constants") and sampler is not None:
        resolved.log_prob_constants = sampler.log_prob_constants
    return bad


def step_noise_levels(request: rollout_pb2.RolloutRequest) -> list[float]:
    """[T]: the noise level of each step of a resolved request (a branch point's own, else the
    request's)."""
    levels = [request.noise_level] * request.num_steps
    for branch in request.branches:
        if branch.HasField("noise_level"):
            levels[branch.step] = branch.noise_level
    return levels


def unstable_step_problems(resolved: rollout_pb2.RolloutRequest) -> Problems:
    """A trainer's schedule whose step coefficients are not finite in float32 for the request's
    sampler, noise levels, stochastic steps and solver (each step probed as a rollout takes it)."""
    sigmas = torch.tensor(list(resolved.sigmas), dtype=torch.float32)
    sampler = steps.SAMPLERS_BY_ENUM[resolved.sampler]
    solver = solvers.SOLVERS_BY_ENUM[resolved.solver].name
    levels = step_noise_levels(resolved)
    i = unstable_step(sampler.name, solver, sigmas, levels, list(resolved.stochastic_steps))
    if i is None:
        return []
    return [
        (
            "sigmas",
            f"step {i} (sigma {resolved.sigmas[i]:.9g} to {resolved.sigmas[i + 1]:.9g}): its coefficients "
            f"are not finite in float32 (sampler {sampler.name}, noise level {levels[i]:g}, solver {solver})",
        )
    ]
