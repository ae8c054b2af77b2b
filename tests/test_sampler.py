"""The step-wise sampler in process: each step matches the float64 reference formulas, and rollouts
advanced in an interleaving (as the engine batching several does) each get their solo trajectory
bitwise."""

import numpy as np
import torch
from support.reference import log_prob, mean_and_sd

from rollout_core import noise
from rollout_server.sampler import SamplerPlan, advance, init


def plan(sampler_type: str, seeds: list[int], noise_level: float, latent_dtype=torch.float32) -> SamplerPlan:
    return SamplerPlan(
        sampler_type=sampler_type,
        sigmas=torch.tensor([1.0, 0.8, 0.55, 0.3, 0.1, 0.0]),
        stochastic=[True, False, True, True, False],
        solver="euler",
        noise_levels=[noise_level] * 5,
        log_prob_constants=sampler_type != "CPS",
        latent_dtype=latent_dtype,
        seeds=seeds,
        latent_shape=(6, 4),
        device=torch.device("cpu"),
    )


def velocity(x: torch.Tensor, i: int) -> torch.Tensor:
    """A stand-in for the model: any fixed function of (x, i) will do."""
    return torch.tanh(x) * (i + 1) - 0.1 * x


def assert_same_records(a, b) -> None:
    assert [r.index for r in a] == [r.index for r in b]
    for one, two in zip(a, b, strict=True):
        assert one.stochastic == two.stochastic
        assert torch.equal(one.x_next, two.x_next) and torch.equal(one.mean, two.mean)
        assert (one.log_probs is None) == (two.log_probs is None)
        if one.log_probs is not None:
            assert torch.equal(one.log_probs, two.log_probs) and torch.equal(one.eps, two.eps)


def solo(p: SamplerPlan) -> list:
    """The records of ``p`` run alone, start to end."""
    state = init(p)
    return [advance(p, state, velocity(state.x, state.step)) for _ in range(p.num_steps)]


def test_each_step_matches_the_float64_reference():
    """x_0 is the seeds' noise, and every step's mean, x_{i+1} and log-prob follow the reference
    formulas (float64, written independently) from the streamed x_i and velocity."""
    for p in (plan("FLOW_SDE", [3, 4], 0.7), plan("CPS", [5], 0.5), plan("DANCE", [6, 7], 1.2)):
        state = init(p)
        assert torch.equal(state.x, noise.initial_noise(p.seeds, p.latent_shape))
        for i in range(p.num_steps):
            x = state.x.double().numpy()
            v = velocity(state.x, i)
            record = advance(p, state, v)
            kind = p.sampler_type if p.stochastic[i] else "ODE"
            mean, sd = mean_and_sd(
                kind, x, v.double().numpy(), p.sigmas.double().numpy(), i, p.noise_levels[i]
            )
            np.testing.assert_allclose(record.mean.numpy(), mean, rtol=1e-5, atol=1e-6)
            if p.stochastic[i]:
                eps = noise.step_noise(p.seeds, i, p.latent_shape).double().numpy()
                np.testing.assert_allclose(record.x_next.numpy(), mean + sd * eps, rtol=1e-5, atol=1e-6)
                x_next = record.x_next.double().numpy()
                expected = log_prob(x_next, mean, sd, p.log_prob_constants)
                # The sampler scores sd * eps; the reference scores the fp32 x_{i+1} against the
                # float64 mean, whose residual is off by x_{i+1}'s rounding and the fp32 mean's (at
                # most u |x'| + 4 u |mean|). Each element's quadratic term moves by |eps| times that
                # over sd (constants: (x' - mean)^2 / 2 sd^2) or 2 |x' - mean| times it (CPS), and
                # the fp32 log-prob itself rounds by a few u of its terms.
                u = 2.0**-24
                residual = u * np.abs(x_next).max() + 4 * u * np.abs(mean).max()
                scale = np.abs(eps).max() / sd if p.log_prob_constants else 2 * np.abs(x_next - mean).max()
                terms = np.abs(eps).max() ** 2 / 2 + abs(np.log(sd)) + 1
                atol = scale * residual + 8 * u * terms
                np.testing.assert_allclose(record.log_probs.numpy(), expected, rtol=0, atol=atol)
            else:
                assert record.log_probs is None
                np.testing.assert_allclose(record.x_next.numpy(), mean, rtol=1e-5, atol=1e-6)


def test_interleaved_rollouts_each_get_their_solo_trajectory():
    """Two rollouts with different samplers, seeds and noise levels, started two steps apart and
    advanced alternately, step exactly as each does alone."""
    plans = [plan("FLOW_SDE", [11, 12], 0.7), plan("CPS", [13], 0.9)]
    states = [init(p) for p in plans]
    records: list[list] = [[], []]
    for _ in range(2):
        records[0].append(advance(plans[0], states[0], velocity(states[0].x, states[0].step)))
    while any(state.step < p.num_steps for p, state in zip(plans, states, strict=True)):
        for k in (1, 0):
            if states[k].step < plans[k].num_steps:
                records[k].append(advance(plans[k], states[k], velocity(states[k].x, states[k].step)))
    for p, got in zip(plans, records, strict=True):
        assert_same_records(got, solo(p))
