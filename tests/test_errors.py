"""Malformed requests: INVALID_ARGUMENT with google.rpc.BadRequest details naming the field.

Hostile requests too: huge violation lists stay small, client strings never reach the log raw, and
bytes that are not a protobuf are INVALID_ARGUMENT, not INTERNAL. The server keeps serving."""

import math

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.errors import field_violations
from support.families import family_request
from support.requests import make_request
from support.servers import vm_rss_bytes

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_core import wire
from rollout_server.sampler import LATENT_RANGE

VALID = {
    "prompts": ["a red fox"],
    "base_seed": 1,
    "height": 64,
    "width": 64,
    "num_steps": 2,
    "manifest_only": True,
    "images": False,
}
ODE, DANCE = rollout_pb2.SAMPLER_TYPE_ODE, rollout_pb2.SAMPLER_TYPE_DANCE
EPS, MEAN = rollout_pb2.DEBUG_TENSOR_EPS, rollout_pb2.DEBUG_TENSOR_MEAN
# tiny-flux's x_0 at 64 x 64 for VALID's one sample: 4 x 4 packed tokens of 16 channels.
X0_SHAPE = (1, 16, 16)


def sigmas_of_one_log_snr() -> list[float]:
    """Two neighbouring float32 sigmas from 1e-30 down whose log-SNRs, log(1 - s) - log(s) in float32
    as rollout_core.solvers computes them, are equal here: near log(1e-30) = -69 an ulp is 7.6e-6,
    and neighbours' logs differ by about 1e-7, so most such pairs round together. UniPC's step
    between them has h = 0, and the next step's corrector divides 0 by 0."""

    def log_snr(s: torch.Tensor) -> torch.Tensor:
        return torch.log(1 - s) - torch.log(s)

    s, zero = torch.tensor(1e-30), torch.tensor(0.0)
    while log_snr(s) != log_snr(s.nextafter(zero)):
        s = s.nextafter(zero)
    return [s.item(), s.nextafter(zero).item()]


def x0_buffer(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


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
    ("noise-above-max", {"noise_level": 3.5}, "noise_level"),
    ("cps-noise-above-one", {"sampler": rollout_pb2.SAMPLER_TYPE_CPS, "noise_level": 1.2}, "noise_level"),
    ("min-policy-version-at-uint64-max", {"min_policy_version": 2**64 - 1}, "min_policy_version"),
    ("frames-of-an-image-model", {"num_frames": 5}, "num_frames"),
    ("zero-frames", {"num_frames": 0}, "num_frames"),
    ("noise-underflows", {"noise_level": 1e-30}, "noise_level"),
    ("stochastic-step-out-of-range", {"stochastic_steps": [2]}, "stochastic_steps"),
    ("stochastic-steps-decreasing", {"stochastic_steps": [1, 0]}, "stochastic_steps"),
    ("stochastic-steps-repeated", {"stochastic_steps": [1, 1]}, "stochastic_steps"),
    ("stochastic-steps-with-ode", {"sampler": ODE, "stochastic_steps": [0]}, "stochastic_steps"),
    ("unknown-solver", {"solver": 9}, "solver"),
    ("sigmas-one-value", {"num_steps": None, "sigmas": [0.0]}, "sigmas"),
    (
        "sigmas-too-many",
        {"num_steps": None, "sigmas": [1.0, *[0.5 - k / 1000 for k in range(100)], 0.0]},
        "sigmas",
    ),
    ("sigmas-not-num-steps-plus-one", {"sigmas": [1.0, 0.6, 0.3, 0.0]}, "sigmas"),
    ("sigmas-nan", {"sigmas": [math.nan, 0.5, 0.0]}, "sigmas"),
    ("sigmas-last-not-zero", {"sigmas": [1.0, 0.5, 0.1]}, "sigmas"),
    ("sigmas-above-one", {"sigmas": [1.5, 0.5, 0.0]}, "sigmas"),
    ("sigmas-zero-before-the-end", {"sigmas": [1.0, 0.0, 0.0]}, "sigmas"),
    ("sigmas-not-decreasing", {"sigmas": [0.5, 0.8, 0.0]}, "sigmas"),
    # Subnormal, refused as such: at the default noise level 0.7 DANCE's x coefficient 1 + a^2 dt / (2 s)
    # would overflow (0.49 / 2e-40 is beyond float32).
    ("sigmas-subnormal", {"sampler": DANCE, "num_steps": None, "sigmas": [1.0, 0.5, 1e-40, 0.0]}, "sigmas"),
    # Normal, but at noise level 3 a^2 / (2 s) = 9 / 2.4e-38 = 3.75e38 overflows float32 all the same.
    (
        "sigmas-dance-coefficient-overflows",
        {"sampler": DANCE, "noise_level": 3.0, "num_steps": None, "sigmas": [1.0, 0.5, 1.2e-38, 0.0]},
        "sigmas",
    ),
    (
        "sigmas-unipc-log-snr-step-of-zero",
        {
            "sampler": ODE,
            "solver": rollout_pb2.SOLVER_UNIPC,
            "num_steps": None,
            "sigmas": [1.0, 0.5, *sigmas_of_one_log_snr(), 0.0],
        },
        "sigmas",
    ),
    ("initial-latents-not-safetensors", {"initial_latents": b"\x08" + bytes(20)}, "initial_latents"),
    ("initial-latents-too-large", {"initial_latents": bytes(16 * 16 * 4 + 4097)}, "initial_latents"),
    (
        "initial-latents-other-name",
        {"initial_latents": x0_buffer({"x0": torch.zeros(X0_SHAPE)})},
        "initial_latents",
    ),
    (
        "initial-latents-two-tensors",
        {"initial_latents": x0_buffer({"x_0": torch.zeros(X0_SHAPE), "y": torch.zeros(1)})},
        "initial_latents",
    ),
    (
        "initial-latents-float16",
        {"initial_latents": x0_buffer({"x_0": torch.zeros(X0_SHAPE, dtype=torch.float16)})},
        "initial_latents",
    ),
    (
        "initial-latents-wrong-shape",
        {"initial_latents": wire.initial_latents_bytes(torch.zeros(1, 16, 8))},
        "initial_latents",
    ),
    (
        "initial-latents-two-samples-for-one",
        {"initial_latents": wire.initial_latents_bytes(torch.zeros(2, 16, 16))},
        "initial_latents",
    ),
    (
        "initial-latents-nan",
        {"initial_latents": wire.initial_latents_bytes(torch.full(X0_SHAPE, math.nan))},
        "initial_latents",
    ),
    (
        "initial-latents-beyond-the-latent-range",
        {"initial_latents": wire.initial_latents_bytes(torch.full(X0_SHAPE, 1e20))},
        "initial_latents",
    ),
    ("unknown-latents", {"latents": 42}, "latents"),
    ("unknown-latent-dtype", {"latent_dtype": 7}, "latent_dtype"),
    ("unspecified-debug-tensor", {"debug_tensors": [rollout_pb2.DEBUG_TENSOR_UNSPECIFIED]}, "debug_tensors"),
    ("unknown-debug-tensor", {"debug_tensors": [EPS, 9]}, "debug_tensors"),
    ("duplicate-debug-tensor", {"debug_tensors": [EPS, MEAN, EPS]}, "debug_tensors"),
    ("request-id-too-long", {"request_id": "r" * 129}, "request_id"),
    ("request-id-not-printable", {"request_id": "bad\nid"}, "request_id"),
]


def rejection(stub, request: rollout_pb2.RolloutRequest) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """Send ``request``, expect INVALID_ARGUMENT, and return its BadRequest field violations."""
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Rollout(request, timeout=60))
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    status = rpc_status.from_call(error)
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert all(detail.Is(error_details_pb2.BadRequest.DESCRIPTOR) for detail in status.details)
    return field_violations(error)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


@pytest.mark.parametrize(
    "overrides, field", [case[1:] for case in MALFORMED], ids=[name for name, *_ in MALFORMED]
)
def test_malformed_request_names_the_field(stub, overrides, field):
    """Each malformed request is rejected with exactly one violation, naming the bad field."""
    violations = rejection(stub, make_request(VALID, overrides))
    assert [violation.field for violation in violations] == [field]
    assert violations[0].description


def test_initial_latents_are_bounded_at_the_latent_range(stub, client):
    """An x_0 whose elements reach LATENT_RANGE (1024) in magnitude, of either sign, runs from that
    x_0 bitwise; one float32 step beyond it is refused naming initial_latents."""
    x0 = torch.full(X0_SHAPE, LATENT_RANGE)
    x0[0, 0, 0] = -LATENT_RANGE
    (trajectory,) = client.rollout(
        make_request(VALID, manifest_only=False, initial_latents=wire.initial_latents_bytes(x0))
    )
    # Bitwise: with float32 latents the x_0 sent is the x_0 used (its rounding to the dtype is none).
    assert torch.equal(trajectory.latents[0], x0[0]) and trajectory.latents.isfinite().all()
    x0[0, 0, 0] = torch.tensor(-LATENT_RANGE).nextafter(torch.tensor(-math.inf))
    violations = rejection(stub, make_request(VALID, initial_latents=wire.initial_latents_bytes(x0)))
    assert [violation.field for violation in violations] == ["initial_latents"]


def test_every_violation_is_reported(stub):
    """Validation reports all bad fields of a request at once, not just the first."""
    violations = rejection(stub, make_request(VALID, height=72, num_steps=0, latents=42))
    assert {violation.field for violation in violations} == {"height", "num_steps", "latents"}


def test_server_still_serves_after_malformed_requests(client):
    """After all the rejected requests, a valid rollout on the same server succeeds."""
    trajectories = client.rollout(make_request(VALID, samples_per_prompt=2, manifest_only=False))
    assert [trajectory.sample_index for trajectory in trajectories] == [0, 1]
    for trajectory in trajectories:
        assert trajectory.latent_mask.all() and trajectory.log_probs.isfinite().all()


def test_huge_requests_get_a_short_answer(stub, server):
    """A million empty prompts are counted before they are checked: one violation, answered at once;
    64 empty prompts list the first 20 and count the rest, so the status fits gRPC's trailer."""
    violations = rejection(stub, make_request(VALID, prompts=[""] * 1_000_000))
    assert [(v.field, v.description) for v in violations] == [
        ("prompts", "1000000 prompts exceed 64 samples")
    ]

    violations = rejection(stub, make_request(VALID, prompts=[""] * 64))
    assert [v.field for v in violations] == [f"prompts[{i}]" for i in range(20)] + ["..."]
    assert violations[-1].description == "and 44 more violations"
    assert max(map(len, server.log().splitlines())) < 4000


def test_refused_requests_leave_no_memory_behind(server):
    """A refused request's memory is freed with its call. 40 requests of a million empty prompts
    (2 MB each on the wire, tens of MB once parsed) raise the server's RSS by less than 150 MB: the
    allocator's slack for a few such requests, where keeping each one would take over a GB."""
    huge = make_request(VALID, prompts=[""] * 1_000_000).SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        rollout = channel.unary_stream("/rollout.v1.RolloutService/Rollout")

        def refuse() -> None:
            with pytest.raises(grpc.RpcError) as raised:
                list(rollout(huge, timeout=60))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()

        for _ in range(5):  # the allocator's working set for such a request
            refuse()
        before = vm_rss_bytes(server.process.pid)
        for _ in range(40):
            refuse()
        growth = vm_rss_bytes(server.process.pid) - before
    assert growth < 150 * 2**20, f"RSS grew by {growth / 2**20:.0f} MB"


def test_client_strings_reach_the_log_escaped_and_cut(stub, server):
    """A rejected request's id is logged escaped (no forged log line) and cut (no 1 MB line)."""
    rejection(stub, make_request(VALID, request_id="abc\nINJECTED fake log line", prompts=[""]))
    rejection(stub, make_request(VALID, request_id="x" * 1_000_000, prompts=[""]))
    lines = server.log().splitlines()
    assert not any(line.startswith("INJECTED") for line in lines)
    assert any("'abc\\nINJECTED fake log line'" in line for line in lines)
    assert max(map(len, lines)) < 4000


@pytest.mark.parametrize("method", ["Rollout", "GetServerInfo", "LoadWeights", "UpdateWeights"])
def test_bytes_that_are_not_a_protobuf(server, method):
    """Garbage bytes as a request are INVALID_ARGUMENT naming the request, with no traceback."""
    path = f"/rollout.v1.RolloutService/{method}"
    garbage = b"\xff\xff\xff\xff"
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as raised:
        if method == "Rollout":
            list(channel.unary_stream(path)(garbage, timeout=60))
        elif method == "UpdateWeights":
            channel.stream_unary(path)(iter([garbage]), timeout=60)
        else:
            channel.unary_unary(path)(garbage, timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert "request: the message is not a valid protobuf" in raised.value.details()
    assert "Traceback" not in server.log()


@pytest.mark.parametrize(
    "sampler, noise_level",
    [
        (rollout_pb2.SAMPLER_TYPE_FLOW_SDE, 1.2),
        (rollout_pb2.SAMPLER_TYPE_DANCE, 3.0),
        (rollout_pb2.SAMPLER_TYPE_CPS, 1.0),
    ],
)
def test_noise_level_bound_is_per_sampler(client, sampler, noise_level):
    """FlowGRPO's larger SDE noise levels are accepted (CPS stays at most 1, see MALFORMED)."""
    info = client.server_info()
    assert dict(info.limits.max_noise_levels) == {"FLOW_SDE": 3.0, "DANCE": 3.0, "CPS": 1.0, "ODE": 3.0}
    (trajectory,) = client.rollout(
        make_request(VALID, sampler=sampler, noise_level=noise_level, manifest_only=False)
    )
    assert trajectory.log_probs[trajectory.stochastic].isfinite().all()


@pytest.mark.parametrize(
    "family, field, value",
    [
        ("sd3", "true_cfg_scale", 3.0),
        ("wan", "true_cfg_scale", 3.0),
        ("qwen-image", "guidance_scale", 3.5),
        ("flux2-klein", "true_cfg_scale", 3.0),
        ("flux2", "true_cfg_scale", 3.0),
        ("z-image", "true_cfg_scale", 3.0),
        ("hunyuan-video15", "true_cfg_scale", 3.0),
    ],
)
def test_a_scale_the_model_does_not_read_is_refused(family, field, value, family_client):
    """SD3, Wan, FLUX.2 [klein], Z-Image and HunyuanVideo 1.5 take their CFG scale from guidance_scale,
    Qwen-Image (no embedded guidance) from true_cfg_scale: the other scale would be silently ignored,
    so it is INVALID_ARGUMENT naming it. The default, which a started event echoes, is still accepted, so a
    resolved request can be resent."""
    request = family_request(family, "ODE", cfg=False, num_steps=2, **{field: value})
    with pytest.raises(grpc.RpcError) as raised:
        family_client.rollout(request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [violation.field for violation in field_violations(raised.value)] == [field]
    setattr(request, field, getattr(family_client.server_info().defaults, field))
    assert len(family_client.rollout(request)) == 4


@pytest.mark.parametrize("family", ["qwen-image"])
def test_one_step_is_refused_where_the_schedule_needs_two(family, family_client):
    """Qwen-Image's scheduler stretches its sigmas to end at shift_terminal, which one step cannot do
    (every sigma would be NaN): num_steps 1 is INVALID_ARGUMENT naming it, and 2 runs."""
    with pytest.raises(grpc.RpcError) as raised:
        family_client.rollout(family_request(family, "ODE", cfg=False, num_steps=1))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [violation.field for violation in field_violations(raised.value)] == ["num_steps"]
    assert "must be in [2, " in raised.value.details()
    (trajectory, *_) = family_client.rollout(family_request(family, "ODE", cfg=False, num_steps=2))
    assert trajectory.sigmas.isfinite().all()
