"""The step-wise sampler in process: advancing a rollout one step at a time reproduces ``sample``
bitwise, and rollouts advanced in an interleaving (as an engine batching several would) each get
their solo trajectory."""

import torch

from rollout_server.sampler import SamplerHooks, SamplerPlan, advance, init, sample


def plan(sampler_type: str, seeds: list[int], noise_level: float, latent_dtype=torch.float32) -> SamplerPlan:
    return SamplerPlan(
        sampler_type=sampler_type,
        sigmas=torch.tensor([1.0, 0.8, 0.55, 0.3, 0.1, 0.0]),
        stochastic=[True, False, True, True, False],
        noise_level=noise_level,
        log_prob_constants=sampler_type != "CPS",
        latent_dtype=latent_dtype,
        seeds=seeds,
        latent_shape=(6, 4),
        device=torch.device("cpu"),
    )


def velocity(x: torch.Tensor, i: int) -> torch.Tensor:
    """A stand-in for the model: any fixed function of (x, i) will do."""
    return torch.tanh(x) * (i + 1) - 0.1 * x


class Recorder(SamplerHooks):
    def __init__(self):
        self.x0, self.records = None, []

    def on_start(self, x0) -> None:
        self.x0 = x0

    def on_step(self, record) -> None:
        self.records.append(record)


def assert_same_records(a, b) -> None:
    assert [r.index for r in a] == [r.index for r in b]
    for one, two in zip(a, b, strict=True):
        assert one.stochastic == two.stochastic
        assert torch.equal(one.x_next, two.x_next) and torch.equal(one.mean, two.mean)
        assert (one.log_probs is None) == (two.log_probs is None)
        if one.log_probs is not None:
            assert torch.equal(one.log_probs, two.log_probs) and torch.equal(one.eps, two.eps)


def solo(p: SamplerPlan) -> Recorder:
    hooks = Recorder()
    sample(p, velocity, hooks)
    return hooks


def test_advance_step_by_step_is_sample():
    for p in (
        plan("FLOW_SDE", [3, 4], 0.7),
        plan("CPS", [5], 0.5),
        plan("DANCE", [6, 7], 1.2, torch.bfloat16),
    ):
        state = init(p)
        x0 = state.x.clone()
        records = [advance(p, state, velocity(state.x, state.step)) for _ in range(p.num_steps)]
        reference = solo(p)
        assert torch.equal(x0, reference.x0) and state.step == p.num_steps
        assert_same_records(records, reference.records)


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
        assert_same_records(got, solo(p).records)
