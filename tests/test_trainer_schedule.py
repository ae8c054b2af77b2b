"""A trainer's own schedule (``RolloutRequest.sigmas``) and x_0 (``initial_latents``) on the tiny-flux
server: used as sent, echoed, replayed, with the eps of the seeds; each bad form is refused naming
the field (in test_errors.py's table)."""

import hashlib

import pytest
import torch
from safetensors.torch import load
from support.families import family_request
from support.parity import assert_replays
from support.requests import split_events

from rollout.v1 import rollout_pb2
from rollout_client import regenerate_deterministic_steps
from rollout_core import wire
from rollout_core.layout import prompt_groups, sample_layout

# Four steps from 1 with a MixGRPO-like stretch in the middle: not any family's own schedule.
SIGMAS = [1.0, 0.93, 0.61, 0.35, 0.0]
VELOCITY = rollout_pb2.DEBUG_TENSOR_VELOCITY


@pytest.fixture
def family() -> str:
    return "flux"


def test_a_trainers_sigmas_are_used_echoed_and_replayed(family_client, family_transformer):
    """The stream's schedule is the trainer's float32 values bitwise, in the resolved request and as
    used; the timesteps are sigma * 1000; x_0 and every eps are the seeds' (a run on the family's
    schedule draws the same); the stochastic steps replay and the deterministic ones regenerate."""
    fields = {
        "stochastic_steps": [1, 2],
        "solver": rollout_pb2.SOLVER_DPMPP_2M,
        "debug_tensors": [VELOCITY, rollout_pb2.DEBUG_TENSOR_EPS],
    }
    request = family_request("flux", "FLOW_SDE", cfg=True, num_steps=None, sigmas=SIGMAS, **fields)
    run = split_events(family_client.stream(request))
    started = run.started.message
    sent = torch.tensor(SIGMAS, dtype=torch.float32)
    assert torch.equal(torch.tensor(list(started.resolved.sigmas)), sent)
    assert torch.equal(torch.tensor(list(started.sigmas)), sent)
    assert torch.equal(torch.tensor(list(started.timesteps)), sent * 1000)
    assert started.resolved.num_steps == 4
    own = split_events(family_client.stream(family_request("flux", "FLOW_SDE", cfg=True, **fields)))
    assert not torch.equal(torch.tensor(list(own.started.message.sigmas)), sent)
    assert torch.equal(run.started.x0, own.started.x0)
    for mine, theirs in zip(run.steps, own.steps, strict=True):
        if mine.stochastic:
            assert torch.equal(mine.debug["eps"], theirs.debug["eps"])
    trajectories = run.trajectories()
    assert_replays(family_transformer, trajectories, bare_reference=True)
    velocities = torch.stack([step.debug["velocity"] for step in run.steps], dim=1)
    for trajectory, v in zip(trajectories, velocities, strict=True):
        regenerated = regenerate_deterministic_steps(trajectory, v)
        for i in (0, 3):
            assert torch.equal(regenerated[i], trajectory.latents[i + 1])


def test_the_resolved_request_with_its_sigmas_can_be_sent_again(family_client):
    """A started event's resolved request, resent as it is, runs the same rollout bitwise."""
    request = family_request("flux", "ODE", cfg=False, num_steps=None, sigmas=SIGMAS)
    first = split_events(family_client.stream(request))
    again = split_events(family_client.stream(first.started.message.resolved))
    assert list(again.started.message.sigmas) == list(first.started.message.sigmas)
    for one, two in zip(first.steps, again.steps, strict=True):
        assert torch.equal(one.x_next, two.x_next)


def test_a_trainers_x0_is_used_echoed_and_replayed(family_client, family_transformer):
    """A trainer's x_0 is the stream's x_0 bitwise, its SHA-256 echoed and its bytes left out of the
    resolved request; the eps of the stochastic steps are the seeds' as without it; every stochastic
    step replays. Split by prompt group (as a pool splits it), each group gets its own rows."""
    fields = {"debug_tensors": [rollout_pb2.DEBUG_TENSOR_EPS], "sigmas": SIGMAS, "num_steps": None}
    plain = split_events(family_client.stream(family_request("flux", "FLOW_SDE", cfg=False, **fields)))
    x0 = 0.5 * plain.started.x0 + 0.25  # not the seeds' noise
    data = wire.initial_latents_bytes(x0)
    request = family_request("flux", "FLOW_SDE", cfg=False, initial_latents=data, **fields)
    run = split_events(family_client.stream(request))
    started = run.started.message
    assert torch.equal(run.started.x0, x0)
    assert started.initial_latents_sha256 == hashlib.sha256(data).hexdigest()
    assert not started.resolved.initial_latents
    for mine, theirs in zip(run.steps, plain.steps, strict=True):
        assert torch.equal(mine.debug["eps"], theirs.debug["eps"])
    assert not torch.equal(run.steps[-1].x_next, plain.steps[-1].x_next)
    assert_replays(family_transformer, run.trajectories(), bare_reference=True)
    layout, _ = sample_layout(request, 64)
    second = prompt_groups(request, layout, [1])
    assert torch.equal(load(second.initial_latents)[wire.X_0], x0[2:])
