"""Comparisons across paths (docs/testing.md): two runs of one request, and replay parity of a stream."""

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rollout_client import Trajectory, replay_log_probs
from support import reference

if TYPE_CHECKING:
    from support.requests import Rollout

# Replay parity (docs/design.md, invariant 1): a replayed log-prob is within this of the streamed one.
TOLERANCE = 1e-5


def assert_same_kwargs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same transformer kwargs: tensors bitwise equal, other values equal."""
    assert a.keys() == b.keys()
    for key, value in a.items():
        same = torch.equal(value, b[key]) if isinstance(value, torch.Tensor) else value == b[key]
        assert same, key


def assert_same_env(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> None:
    """Two started events' envs are the same, branch by branch and prompt by prompt."""
    assert a.keys() == b.keys()
    for branch in a:
        for kwargs_a, kwargs_b in zip(a[branch], b[branch], strict=True):
            assert_same_kwargs(kwargs_a, kwargs_b)


def assert_same_numbers(
    a: "Rollout", b: "Rollout", bitwise_log_probs: bool, tolerance: float = TOLERANCE
) -> None:
    """Two runs of one request (another SP degree, alone or batched with other rollouts): x_0 and every
    eps bitwise, latents and (when streamed) velocities within ``tolerance``, log-probs bitwise or
    within TOLERANCE."""
    assert torch.equal(a.started.x0, b.started.x0)
    assert [step.index for step in a.steps] == [step.index for step in b.steps]
    for one, two in zip(a.steps, b.steps, strict=True):
        assert one.stochastic == two.stochastic
        torch.testing.assert_close(one.x_next, two.x_next, atol=tolerance, rtol=0)
        if "velocity" in one.debug:
            torch.testing.assert_close(one.debug["velocity"], two.debug["velocity"], atol=tolerance, rtol=0)
        if one.stochastic:
            assert torch.equal(one.debug["eps"], two.debug["eps"])
            if bitwise_log_probs:
                assert torch.equal(one.log_probs, two.log_probs), one.index
            else:
                torch.testing.assert_close(one.log_probs, two.log_probs, atol=TOLERANCE, rtol=0)


def stochastic_steps(trajectory: Trajectory) -> list[int]:
    return torch.nonzero(trajectory.stochastic).flatten().tolist()


def assert_replays(
    transformer: torch.nn.Module, trajectories: Iterable[Trajectory], bare_reference: bool = False
) -> None:
    """Every stochastic step of each trajectory, replayed through ``transformer`` by the client
    library (and with ``bare_reference`` also by a bare diffusers call and the float64 formulas of
    reference.py), scores within TOLERANCE of the streamed log-prob; the other steps stay NaN."""
    for trajectory in trajectories:
        streamed = trajectory.log_probs
        replayed = replay_log_probs(transformer, trajectory)
        np.testing.assert_allclose(replayed.numpy(), streamed.numpy(), atol=TOLERANCE, rtol=0, equal_nan=True)
        if bare_reference:
            bare = reference.bare_log_probs(transformer, trajectory)
            assert bare.keys() == set(stochastic_steps(trajectory))
            for i, value in bare.items():
                assert abs(value - streamed[i].item()) <= TOLERANCE, (i, value, streamed[i].item())
