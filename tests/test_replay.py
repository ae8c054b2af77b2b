"""Replay parity over gRPC through the real tiny transformers (docs/design.md, invariant 1).

For every stochastic step a trainer recomputes the log-prob from the streamed x_i, timestep and env
and scores the streamed x_{i+1}; it must match the streamed log-prob within 1e-5. Checked for every
family (flux, sd3, qwen-image, wan, z-image, ...), sampler and CFG setting twice: with the client library's
``replay_log_probs`` and with a bare diffusers call plus the independent float64 reference formula
of ``reference.py``.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.errors import refused_rollout
from support.families import FAMILIES, LONG_PROMPT, SHORT_PROMPT, family_request, qwen_text_length
from support.parity import TOLERANCE, assert_replays, assert_same_kwargs
from support.requests import LATENT_DTYPES, make_request, split_events, stream_events

from rollout.v1 import rollout_pb2
from rollout_client import Trajectory, replay_log_probs
from rollout_core import wire
from rollout_core.transformer_call import LatentConditioning


def replay_case(family: str, sampler: str, cfg: bool, dtype: str | None):
    name = "-".join(filter(None, (family, sampler, "cfg" if cfg else "no-cfg", dtype)))
    return pytest.param(family, sampler, cfg, dtype, id=name)


# Every family, each of its samplers with CFG off and on, at each of its latent dtypes (see FAMILIES:
# flux and z-image also cover DANCE and bfloat16 latents; qwen-image's and z-image's two prompts
# differ in length).
REPLAY_CASES = [
    replay_case(family, sampler, cfg, dtype)
    for family, spec in FAMILIES.items()
    for sampler in spec.replay_samplers
    for cfg in spec.replay_cfg
    for dtype in spec.replay_latent_dtypes
]


@pytest.mark.parametrize(("family", "sampler", "cfg", "latent_dtype"), REPLAY_CASES)
def test_streamed_log_probs_replay(
    family, family_client, family_transformer, family_resources, sampler, cfg, latent_dtype
):
    spec = FAMILIES[family]
    config = family_transformer["transformer"].config if len(spec.experts) > 1 else family_transformer.config
    request = family_request(family, sampler, cfg, latent_dtype=LATENT_DTYPES.get(latent_dtype))
    trajectories = family_client.rollout(request)
    assert [t.prompt_index for t in trajectories] == [0, 0, 1, 1]
    for trajectory in trajectories:
        call = trajectory.transformer_call
        assert call.timestep_divisor == spec.timestep_divisor
        rule = spec.cfg_rule if cfg else spec.cfg_off_rule
        assert (call.guidance_rule, call.guidance_rule_scale) == rule
        concat, env_key = spec.conditioning
        assert call.conditioning == LatentConditioning(rollout_pb2.ConditioningConcat.Value(concat), env_key)
        assert set(trajectory.env) == ({"positive", "negative"} if cfg else {"positive"})
        for env in trajectory.env.values():
            assert set(env) == spec.env_keys
            if spec.text_key:
                assert env[spec.text_key].shape[::2] == (1, config[spec.text_width])
            if "pooled_projections" in env:
                assert env["pooled_projections"].shape == (1, config.pooled_projection_dim)
        assert trajectory.latents.shape == (5, *spec.latent_shape)
        assert trajectory.step_transformers == list(spec.step_transformers)
        assert trajectory.latent_mask.all()
        # CPS's last step goes into sigma_T = 0 with sd = 0: deterministic, not scored.
        stochastic = [True, True, True, False] if sampler == "CPS" else [True] * 4
        assert trajectory.stochastic.tolist() == stochastic
        streamed = trajectory.log_probs
        assert torch.isfinite(streamed[trajectory.stochastic]).all()
        assert torch.isnan(streamed[~trajectory.stochastic]).all()
        if latent_dtype == "bfloat16":
            assert torch.equal(trajectory.latents, trajectory.latents.to(torch.bfloat16).float())
    assert_replays(family_transformer, trajectories, bare_reference=True)
    # Distinct samples of a group are scored separately (docs/design.md).
    assert not torch.equal(trajectories[0].log_probs, trajectories[1].log_probs)
    if family == "qwen-image":
        assert_each_sample_has_its_own_prompts_env(
            trajectories, family_resources.pipeline(family), family_transformer, cfg
        )


def assert_each_sample_has_its_own_prompts_env(trajectories, pipe, transformer, cfg: bool) -> None:
    """Qwen-Image's two prompts of different lengths in one request: each sample's env has its own
    prompt's length, unpadded, and replays its own sample only."""
    short, long = qwen_text_length(pipe, SHORT_PROMPT), qwen_text_length(pipe, LONG_PROMPT)
    assert short < long
    for trajectory in trajectories:
        lengths = {"positive": (short, long)[trajectory.prompt_index]}
        if cfg:
            lengths["negative"] = qwen_text_length(pipe, FAMILIES["qwen-image"].cfg_on["negative_prompt"])
        for branch, env in trajectory.env.items():
            assert env["encoder_hidden_states"].shape == (
                1,
                lengths[branch],
                transformer.config.joint_attention_dim,
            )
            # One unpadded prompt per env: QwenImagePipeline passes no mask then, and no guidance.
            assert env["encoder_hidden_states_mask"] is None and env["guidance"] is None
            assert env["img_shapes"] == [[[1, 4, 4]]]  # one sample, one frame, a 4x4 patch grid
            assert env["attention_kwargs"] == {} and env["return_dict"] is False
    # The env matters: the long prompt's env does not replay a short-prompt sample.
    trajectories[0].env = trajectories[2].env
    mismatch = replay_log_probs(transformer, trajectories[0]) - trajectories[0].log_probs
    assert mismatch.nan_to_num().abs().max() > TOLERANCE


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cfg_turns_on_through_the_field_server_info_advertises(family, family_client):
    """A client that knows a model only by GetServerInfo turns CFG on by setting ``cfg_scale_field``
    above ``cfg_off_scale``, and gets a rollout with a negative branch combined by ``cfg_rule``. A
    model without CFG (rule "none": FLUX.2 [dev]) advertises no field, and every scale field it does
    not list in ``scale_fields`` is refused above its default, naming it."""
    info = family_client.server_info()
    assert (info.cfg_rule == "none") == (info.cfg_scale_field == "")
    assert set(info.scale_fields) <= {"guidance_scale", "true_cfg_scale"}
    small = {"samples_per_prompt": 1, "num_steps": 2, "latents": rollout_pb2.LATENT_SELECTION_NONE}
    if not info.cfg_scale_field:
        for field in {"guidance_scale", "true_cfg_scale"} - set(info.scale_fields):
            scale = {field: getattr(info.defaults, field) + 2.0}
            refused = family_request(family, "ODE", cfg=False, **small, **scale)
            assert [violation.field for violation in refused_rollout(family_client, refused)] == [field]
        return
    assert info.cfg_scale_field in info.scale_fields
    scale = {info.cfg_scale_field: info.cfg_off_scale + 2.0}
    request = family_request(family, "ODE", cfg=False, **small, **scale)
    started = split_events(family_client.stream(request)).started.message
    call = started.transformer_call
    assert list(call.branches) == ["positive", "negative"]
    assert (call.guidance_rule, call.guidance_rule_scale) == (info.cfg_rule, info.cfg_off_scale + 2.0)


def test_env_velocity_matches_debug_velocity(client, tiny_transformer):
    """A bare transformer call with the streamed env reproduces the server's velocity."""
    rollout = stream_events(
        client,
        prompts=["a lighthouse"],
        samples_per_prompt=2,
        base_seed=5,
        height=64,
        width=64,
        num_steps=3,
        debug_tensors=[rollout_pb2.DEBUG_TENSOR_VELOCITY],
        images=False,
    )
    started = rollout.started
    env = started.env["positive"][0]
    x = started.x0
    for step in rollout.steps:
        timestep = torch.full((2,), started.message.timesteps[step.index]) / 1000
        batched = {
            k: torch.cat([v, v]) if k in ("encoder_hidden_states", "pooled_projections", "guidance") else v
            for k, v in env.items()
        }
        with torch.no_grad():
            velocity = tiny_transformer(hidden_states=x, timestep=timestep, **batched)[0]
        torch.testing.assert_close(velocity, step.debug["velocity"], atol=1e-5, rtol=1e-5)
        x = step.x_next


# Two prompts with CFG: the saved sample is of prompt 1, and has a negative branch.
SAVED_REQUEST = {
    "prompts": ["a windmill", "a harbour at dusk"],
    "samples_per_prompt": 2,
    "base_seed": 9,
    "height": 64,
    "width": 64,
    "num_steps": 3,
    "true_cfg_scale": 2.0,
    "negative_prompt": "dark",
}


def test_saved_trajectory_replays_after_loading(client, tiny_transformer, tmp_path):
    """A trajectory written to disk and loaded back (CFG env, image included) replays identically."""
    request = make_request(
        prompts=["a windmill"],
        samples_per_prompt=2,
        base_seed=9,
        height=64,
        width=64,
        num_steps=3,
        true_cfg_scale=2.0,
        negative_prompt="dark",
    )
    trajectory = client.rollout(request)[1]
    trajectory.save(tmp_path / "t.safetensors")
    loaded = Trajectory.load(tmp_path / "t.safetensors")
    assert loaded.image_png == trajectory.image_png and loaded.image().size == (64, 64)
    assert loaded.seed == trajectory.seed and torch.equal(loaded.latents, trajectory.latents)
    assert loaded.env.keys() == trajectory.env.keys() == {"positive", "negative"}
    torch.testing.assert_close(loaded.log_probs, trajectory.log_probs, rtol=0, atol=0, equal_nan=True)
    assert_replays(tiny_transformer, [loaded])


# The transformer call's fields in the first trainers' files (a JSON object of them).
FIRST_TRANSFORMER_CALL_FIELDS = (
    "transformer_class",
    "model_dtype",
    "timestep_divisor",
    "timestep_rule",
    "branches",
    "guidance_rule",
    "guidance_rule_scale",
    "batched_env_keys",
)


def save_in_the_first_layout(trajectory: Trajectory, path) -> None:
    """Write ``trajectory`` as the first trainers' files hold it: env tensors ``env/<branch>/<kwarg>``
    and the other env values per branch (``env_values``), one ``image_png``, no step experts, and the
    transformer call as a plain dict."""
    tensors = {
        "sigmas": trajectory.sigmas,
        "timesteps": trajectory.timesteps,
        "stochastic": trajectory.stochastic.to(torch.uint8),
        "latents": trajectory.latents,
        "latent_mask": trajectory.latent_mask.to(torch.uint8),
        "log_probs": trajectory.log_probs,
        "image_png": torch.frombuffer(bytearray(trajectory.image_png), dtype=torch.uint8),
    }
    call = trajectory.transformer_call
    values = {}
    for branch, env in trajectory.env.items():
        for key, value in env.items():
            if isinstance(value, torch.Tensor):
                tensors[f"env/{branch}/{key}"] = value.contiguous().clone()
            else:
                values.setdefault(branch, {})[key] = value
    scalars = ("request_id", "sample_index", "prompt_index", "prompt", "seed", "sampler_type", "noise_level")
    scalars += ("log_prob_constants", "policy_version")
    metadata = {
        "trajectory": json.dumps({name: getattr(trajectory, name) for name in scalars}),
        "env_values": json.dumps(values),
        "transformer_call": json.dumps({name: getattr(call, name) for name in FIRST_TRANSFORMER_CALL_FIELDS}),
    }
    save_file(tensors, str(path), metadata=metadata)


def test_saved_env_is_named_as_on_the_wire(client, tmp_path):
    """A saved trajectory names its env as the stream does, under its own prompt index."""
    trajectory = client.rollout(make_request(SAVED_REQUEST))[3]
    assert trajectory.prompt_index == 1
    trajectory.save(tmp_path / "t.safetensors")
    with safe_open(tmp_path / "t.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert {"env/positive/1/encoder_hidden_states", "env/negative/1/encoder_hidden_states"} <= names
    assert all(wire.split_env_name(name)[1] == 1 for name in names if name.startswith("env/"))


def test_trajectories_saved_in_the_first_layout_still_load(client, tiny_transformer, tmp_path):
    trajectory = client.rollout(make_request(SAVED_REQUEST))[3]
    save_in_the_first_layout(trajectory, tmp_path / "first.safetensors")
    loaded = Trajectory.load(tmp_path / "first.safetensors")
    assert loaded.frames_png == [trajectory.image_png] and loaded.step_transformers == []
    assert loaded.transformer_call == trajectory.transformer_call
    assert loaded.env.keys() == trajectory.env.keys() == {"positive", "negative"}
    for branch, env in trajectory.env.items():
        assert_same_kwargs(loaded.env[branch], env)
    assert torch.equal(loaded.latents, trajectory.latents)
    torch.testing.assert_close(loaded.log_probs, trajectory.log_probs, rtol=0, atol=0, equal_nan=True)
    assert_replays(tiny_transformer, [loaded])
