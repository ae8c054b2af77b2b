"""Malformed requests: INVALID_ARGUMENT with google.rpc.BadRequest details naming the field (DESIGN §6)."""

import math

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from rollout.v1 import rollout_pb2, rollout_pb2_grpc

VALID = {
    "prompts": ["a red fox"],
    "base_seed": 1,
    "height": 64,
    "width": 64,
    "num_steps": 2,
    "manifest_only": True,
    "images": False,
}
ODE = rollout_pb2.SAMPLER_TYPE_ODE
EPS, MEAN = rollout_pb2.DEBUG_TENSOR_EPS, rollout_pb2.DEBUG_TENSOR_MEAN

# (id, fields overriding VALID (None: leave unset), the field a violation must name)
MALFORMED = [
    ("no-prompts", {"prompts": []}, "prompts"),
    ("empty-prompt", {"prompts": [""]}, "prompts[0]"),
    ("blank-second-prompt", {"prompts": ["a red fox", " \t "]}, "prompts[1]"),
    ("prompt-too-long", {"prompts": ["x" * 4097]}, "prompts[0]"),
    ("too-many-prompts", {"prompts": ["a red fox"] * 65}, "prompts"),
    ("zero-samples", {"samples_per_prompt": 0}, "samples_per_prompt"),
    ("too-many-samples", {"samples_per_prompt": 65}, "samples_per_prompt"),
    ("wrong-seed-count", {"base_seed": None, "samples_per_prompt": 2, "seeds": [1, 2, 3]}, "seeds"),
    ("duplicate-seeds", {"base_seed": None, "samples_per_prompt": 2, "seeds": [5, 5]}, "seeds"),
    ("seeds-and-base-seed", {"seeds": [3]}, "base_seed"),
    ("height-not-multiple", {"height": 72}, "height"),
    ("height-too-large", {"height": 4096}, "height"),
    ("width-zero", {"width": 0}, "width"),
    ("zero-steps", {"num_steps": 0}, "num_steps"),
    ("too-many-steps", {"num_steps": 101}, "num_steps"),
    ("negative-guidance", {"guidance_scale": -1.0}, "guidance_scale"),
    ("nan-guidance", {"guidance_scale": math.nan}, "guidance_scale"),
    ("true-cfg-below-one", {"true_cfg_scale": 0.5}, "true_cfg_scale"),
    ("negative-prompt-without-cfg", {"negative_prompt": "blurry"}, "negative_prompt"),
    ("negative-prompt-too-long", {"true_cfg_scale": 2.0, "negative_prompt": "x" * 4097}, "negative_prompt"),
    ("unknown-sampler", {"sampler": 99}, "sampler"),
    ("negative-noise", {"noise_level": -0.1}, "noise_level"),
    ("infinite-noise", {"noise_level": math.inf}, "noise_level"),
    ("noise-above-max", {"noise_level": 1.5}, "noise_level"),
    ("noise-underflows", {"noise_level": 1e-30}, "noise_level"),
    ("stochastic-step-out-of-range", {"stochastic_steps": [2]}, "stochastic_steps"),
    ("stochastic-steps-decreasing", {"stochastic_steps": [1, 0]}, "stochastic_steps"),
    ("stochastic-steps-repeated", {"stochastic_steps": [1, 1]}, "stochastic_steps"),
    ("stochastic-steps-with-ode", {"sampler": ODE, "stochastic_steps": [0]}, "stochastic_steps"),
    ("unknown-latents", {"latents": 42}, "latents"),
    ("unknown-latent-dtype", {"latent_dtype": 7}, "latent_dtype"),
    ("unspecified-debug-tensor", {"debug_tensors": [rollout_pb2.DEBUG_TENSOR_UNSPECIFIED]}, "debug_tensors"),
    ("unknown-debug-tensor", {"debug_tensors": [EPS, 9]}, "debug_tensors"),
    ("duplicate-debug-tensor", {"debug_tensors": [EPS, MEAN, EPS]}, "debug_tensors"),
    ("request-id-too-long", {"request_id": "r" * 129}, "request_id"),
    ("request-id-not-printable", {"request_id": "bad\nid"}, "request_id"),
]


def make_request(**overrides) -> rollout_pb2.RolloutRequest:
    fields = {key: value for key, value in {**VALID, **overrides}.items() if value is not None}
    return rollout_pb2.RolloutRequest(**fields)


def rejection(stub, request: rollout_pb2.RolloutRequest) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """Send ``request``, expect INVALID_ARGUMENT, and return its BadRequest field violations."""
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Rollout(request, timeout=60))
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    status = rpc_status.from_call(error)
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    violations = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        assert detail.Unpack(bad_request)
        violations.extend(bad_request.field_violations)
    return violations


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


@pytest.mark.parametrize(
    "overrides, field", [case[1:] for case in MALFORMED], ids=[name for name, *_ in MALFORMED]
)
def test_malformed_request_names_the_field(stub, overrides, field):
    """Each malformed request is rejected with exactly one violation, naming the bad field."""
    violations = rejection(stub, make_request(**overrides))
    assert [violation.field for violation in violations] == [field]
    assert violations[0].description


def test_every_violation_is_reported(stub):
    """Validation reports all bad fields of a request at once, not just the first."""
    violations = rejection(stub, make_request(height=72, num_steps=0, latents=42))
    assert {violation.field for violation in violations} == {"height", "num_steps", "latents"}


def test_server_still_serves_after_malformed_requests(client):
    """After all the rejected requests, a valid rollout on the same server succeeds."""
    trajectories = client.rollout(make_request(samples_per_prompt=2, manifest_only=False))
    assert [trajectory.sample_index for trajectory in trajectories] == [0, 1]
    for trajectory in trajectories:
        assert trajectory.latent_mask.all() and trajectory.log_probs.isfinite().all()
