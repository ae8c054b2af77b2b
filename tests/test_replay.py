"""Replay parity over gRPC through the real tiny transformer (docs/design.md, invariant 1).

For every stochastic step a trainer recomputes the log-prob from the streamed x_i, timestep and env
and scores the streamed x_{i+1}; it must match the streamed log-prob within 1e-5. Checked twice: with
the client library's ``replay_log_probs`` and with a bare diffusers call plus the independent
float64 reference formula of ``reference.py``.
"""

import numpy as np
import pytest
import reference
import torch

from rollout.v1 import rollout_pb2
from rollout_client import Trajectory, replay_log_probs

SAMPLERS = {
    "FLOW_SDE": rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
    "DANCE": rollout_pb2.SAMPLER_TYPE_DANCE,
    "CPS": rollout_pb2.SAMPLER_TYPE_CPS,
}
DTYPES = {"float32": rollout_pb2.TENSOR_DTYPE_FLOAT32, "bfloat16": rollout_pb2.TENSOR_DTYPE_BFLOAT16}
TOLERANCE = 1e-5


@pytest.mark.parametrize("latent_dtype", DTYPES)
@pytest.mark.parametrize("true_cfg", [False, True], ids=["no-cfg", "true-cfg"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_streamed_log_probs_replay(client, tiny_transformer, sampler, true_cfg, latent_dtype):
    request = rollout_pb2.RolloutRequest(
        prompts=["a red fox in the snow", "two cats"],
        samples_per_prompt=2,
        base_seed=11,
        height=64,
        width=64,
        num_steps=4,
        sampler=SAMPLERS[sampler],
        latent_dtype=DTYPES[latent_dtype],
        images=False,
    )
    if true_cfg:
        request.true_cfg_scale = 3.0
        request.negative_prompt = "blurry, low quality"
    trajectories = client.rollout(request)
    assert len(trajectories) == 4
    expected_branches = {"positive", "negative"} if true_cfg else {"positive"}
    for trajectory in trajectories:
        assert set(trajectory.env) == expected_branches
        assert trajectory.latent_mask.all()
        stochastic = trajectory.stochastic.tolist()
        # CPS's last step goes into sigma_T = 0 with sd = 0: deterministic, not scored.
        assert stochastic == ([True, True, True, False] if sampler == "CPS" else [True] * 4)
        streamed = trajectory.log_probs
        assert torch.isfinite(streamed[trajectory.stochastic]).all()
        assert torch.isnan(streamed[~trajectory.stochastic]).all()
        if latent_dtype == "bfloat16":
            assert torch.equal(trajectory.latents, trajectory.latents.to(torch.bfloat16).float())

        replayed = replay_log_probs(tiny_transformer, trajectory)
        np.testing.assert_allclose(replayed.numpy(), streamed.numpy(), atol=TOLERANCE, rtol=0, equal_nan=True)
        for i, value in reference.bare_log_probs(tiny_transformer, trajectory).items():
            assert abs(value - streamed[i].item()) <= TOLERANCE, (i, value, streamed[i].item())


def test_env_velocity_matches_debug_velocity(client, tiny_transformer):
    """A bare transformer call with the streamed env reproduces the server's velocity."""
    request = rollout_pb2.RolloutRequest(
        prompts=["a lighthouse"],
        samples_per_prompt=2,
        base_seed=5,
        height=64,
        width=64,
        num_steps=3,
        debug_tensors=[rollout_pb2.DEBUG_TENSOR_VELOCITY],
        images=False,
    )
    events = list(client.stream(request))
    started = events[0]
    steps = [e for e in events if type(e).__name__ == "Step"]
    env = started.env["positive"][0]
    x = started.x0
    for step in steps:
        timestep = torch.full((2,), started.message.timesteps[step.index]) / 1000
        batched = {
            k: torch.cat([v, v]) if k in ("encoder_hidden_states", "pooled_projections", "guidance") else v
            for k, v in env.items()
        }
        with torch.no_grad():
            velocity = tiny_transformer(hidden_states=x, timestep=timestep, **batched)[0]
        torch.testing.assert_close(velocity, step.debug["velocity"], atol=1e-5, rtol=1e-5)
        x = step.x_next


def test_saved_trajectory_replays_after_loading(client, tiny_transformer, tmp_path):
    """A trajectory written to disk and loaded back (CFG env, image included) replays identically."""
    request = rollout_pb2.RolloutRequest(
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
    replayed = replay_log_probs(tiny_transformer, loaded)
    np.testing.assert_allclose(replayed.numpy(), trajectory.log_probs.numpy(), atol=TOLERANCE, rtol=0)
