"""The sampler's NaN guard: a step whose velocity or next latent is not finite fails the rollout
naming the step and the sample, instead of streaming NaN under status OK: INTERNAL when the model
failed, INVALID_ARGUMENT naming the field when the request's own numbers carried the latent out of
range."""

import math

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from support.errors import field_violations, health_status
from support.requests import make_request
from support.servers import start_server

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient
from rollout_server.errors import NonFiniteStep
from rollout_server.sampler import SamplerPlan, advance, init

REQUEST = {"prompts": ["a red fox"], "samples_per_prompt": 2, "height": 64, "width": 64, "num_steps": 3}
# A trainer's schedule that falls by 5 x a step, from 1 to 0.2^53 (float32's normal numbers reach 1.2e-38).
FALLING_BY_FIVE = [0.2**k for k in range(54)] + [0.0]


def plan(noise_level: float = 0.7) -> SamplerPlan:
    return SamplerPlan(
        sampler_type="FLOW_SDE",
        solver="euler",
        sigmas=torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]),
        stochastic=[True, True, True, False],
        noise_levels=[noise_level] * 4,
        log_prob_constants=True,
        latent_dtype=torch.float32,
        seeds=[11, 12, 13],
        latent_shape=(4, 8),
        device=torch.device("cpu"),
    )


def run_until_failure(p: SamplerPlan, velocity) -> tuple[list[int], NonFiniteStep | None]:
    """Advance a rollout to its end: the steps taken, and the NonFiniteStep that stopped it."""
    state, taken = init(p), []
    try:
        while state.step < p.num_steps:
            taken.append(advance(p, state, velocity(state.x, state.step)).index)
    except NonFiniteStep as error:
        return taken, error
    return taken, None


def test_non_finite_velocity_names_step_and_sample():
    """Sample 1's velocity turns NaN at step 2: the rollout stops there, having streamed steps 0-1."""

    def velocity(x: torch.Tensor, i: int) -> torch.Tensor:
        v = -x
        if i == 2:
            v[1, 3, 5] = math.nan
        return v

    taken, error = run_until_failure(plan(), velocity)
    assert str(error) == "step 2: the velocity of sample 1 is not finite (1 samples)"
    assert taken == [0, 1]


def test_overflowing_next_latent_is_caught():
    """A finite velocity of 3e38 passes step 0 (velocity coefficient dt = -0.25), but at step 1 the
    FLOW_SDE mean scales it by (1 + std_t^2 (1 - s) / (2 s)) dt = -1.375 at noise level 3: x_{i+1}
    overflows float32, and that is caught too. The model's velocity carried the latent out of
    range, not the step coefficients: the model's failure."""
    taken, error = run_until_failure(plan(noise_level=3.0), lambda x, i: torch.full_like(x, 3e38))
    assert str(error) == "step 1: the next latent of sample 0 is not finite (3 samples)"
    assert taken == [0]


@pytest.fixture(scope="module")
def guarded_server(tiny_flux_folder, cache_dir, tmp_path_factory):
    server = start_server(cache_dir, tmp_path_factory.mktemp("logs") / "nan-guard.log")
    yield server
    assert server.stop() == 0


def test_a_policy_that_overflows_fails_its_rollouts(guarded_server, tiny_transformer):
    """A finite update whose output layer overflows float32 is accepted, but every rollout on it
    fails with INTERNAL at step 0 instead of streaming NaN; the server keeps serving, and restoring
    the weights restores the rollouts."""
    original = {name: tiny_transformer.state_dict()[name] for name in ("proj_out.weight", "proj_out.bias")}
    huge = {name: torch.full_like(tensor, 3e38) for name, tensor in original.items()}
    with RolloutClient(guarded_server.address, timeout=120) as client:
        client.update_weights(huge, version=1, kind="subset")
        with pytest.raises(grpc.RpcError) as raised:
            client.rollout(**REQUEST)
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert "step 0: the velocity of sample 0 is not finite (2 samples)" in raised.value.details()
        assert health_status(client.channel) == health_pb2.HealthCheckResponse.SERVING

        client.update_weights(original, version=2, kind="subset")
        trajectories = client.rollout(**REQUEST)
        assert all(
            t.latents.isfinite().all() and t.log_probs[t.stochastic].isfinite().all() for t in trajectories
        )
        assert trajectories[0].policy_version == 2


def test_latents_the_request_carries_out_of_range_are_its_error(client):
    """DANCE at noise level 3 on FALLING_BY_FIVE scales the latent by its x coefficient
    1 + a^2 dt / (2 s) = 1 - 9 * 0.8 / 2 = -2.6 at every step (dt = -0.8 s), while tiny-flux's
    velocities stay near 2 (within LATENT_RANGE): past 1e19 the model's normalisation squares the
    latent beyond float32 and its velocity turns NaN. The request's noise level and schedule carried
    it there: INVALID_ARGUMENT naming noise_level, not INTERNAL. FLOW_SDE at noise level 3 from sigma
    1 - 2^-24 to 0.5 scales the latent by 1 - a^2 (s - s') / (2 (1 - s)), about -3.8e7: within
    float32, beyond float16's 65504, so float16 latents name latent_dtype. The server keeps serving."""
    dance = {"sampler": rollout_pb2.SAMPLER_TYPE_DANCE, "sigmas": FALLING_BY_FIVE}
    float16 = {"sigmas": [1.0, 1 - 2**-24, 0.5, 0.0], "latent_dtype": rollout_pb2.TENSOR_DTYPE_FLOAT16}
    float16["sampler"] = rollout_pb2.SAMPLER_TYPE_FLOW_SDE
    for fields, field in ((dance, "noise_level"), (float16, "latent_dtype")):
        with pytest.raises(grpc.RpcError) as raised:
            client.rollout(make_request(REQUEST, fields, num_steps=None, noise_level=3.0))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
        assert [violation.field for violation in field_violations(raised.value)] == [field]
    assert all(t.latents.isfinite().all() for t in client.rollout(**REQUEST))
