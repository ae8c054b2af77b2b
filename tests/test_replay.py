"""Replay parity over gRPC through the real tiny transformers (docs/design.md, invariant 1), of what a
trainer keeps: the env's velocity against the debug velocity, and trajectories saved and loaded again
(in the current and the first layout). Every family's replay parity, for each sampler and CFG setting,
is the contract's (tests/families/test_contract.py).
"""

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.parity import assert_replays, assert_same_kwargs
from support.requests import make_request, stream_events

from rollout.v1 import rollout_pb2
from rollout_client import Trajectory
from rollout_core import wire


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
