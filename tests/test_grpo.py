"""The trainer helpers: log-probs with gradients match the streamed ones at the rollout's policy and
reach the transformer's weights; group advantages and the clipped loss match their formulas,
computed independently here in float64 NumPy."""

import numpy as np
import pytest
import torch
from helpers import TOLERANCE, make_request, stochastic_steps

from rollout.v1 import rollout_pb2
from rollout_client.grpo import clipped_policy_loss, group_advantages, step_log_probs


@pytest.mark.parametrize(
    "fields",
    [
        {"sampler": rollout_pb2.SAMPLER_TYPE_FLOW_SDE},
        {"sampler": rollout_pb2.SAMPLER_TYPE_CPS, "true_cfg_scale": 3.0, "negative_prompt": "blurry"},
    ],
    ids=["flow-sde", "cps-true-cfg"],
)
def test_step_log_probs_match_the_stream_and_carry_gradients(client, tiny_transformer, fields):
    request = make_request(
        {"prompts": ["a red fox", "two cats"], "samples_per_prompt": 2, "base_seed": 5, "num_steps": 4},
        {"height": 64, "width": 64, "images": False},
        fields,
    )
    trajectories = client.rollout(request)
    weight = tiny_transformer.proj_out.weight
    try:
        for i in stochastic_steps(trajectories[0]):
            log_probs = step_log_probs(tiny_transformer, trajectories, i)
            streamed = torch.stack([t.log_probs[i] for t in trajectories])
            torch.testing.assert_close(log_probs.detach(), streamed, atol=TOLERANCE, rtol=0)
            tiny_transformer.zero_grad(set_to_none=True)
            log_probs.sum().backward()
            assert weight.grad is not None and torch.isfinite(weight.grad).all()
            assert weight.grad.abs().sum() > 0
    finally:
        tiny_transformer.zero_grad(set_to_none=True)


def test_step_log_probs_refuse_a_deterministic_step(client, tiny_transformer):
    request = make_request(
        {"prompts": ["a red fox"], "num_steps": 3, "height": 64, "width": 64, "images": False},
        {"sampler": rollout_pb2.SAMPLER_TYPE_CPS},
    )
    trajectories = client.rollout(request)
    with pytest.raises(ValueError, match="step 2 of sample 0 is not stochastic"):
        step_log_probs(tiny_transformer, trajectories, 2)  # CPS's last step goes to sigma 0


def test_group_advantages_standardise_within_each_group():
    rewards = np.array([1.0, 3.0, 2.0, -1.0, -1.0, -1.0, 0.5, 4.0])
    groups = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    got = group_advantages(torch.tensor(rewards), torch.tensor(groups)).numpy()
    expected = np.empty_like(rewards)
    for g in np.unique(groups):
        values = rewards[groups == g]
        expected[groups == g] = (values - values.mean()) / (values.std() + 1e-4)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert np.all(got[groups == 1] == 0)  # a group with one reward value carries no signal


def test_clipped_policy_loss_is_the_ppo_surrogate():
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(64, generator=generator, dtype=torch.float64)
    new = old + 0.3 * torch.randn(64, generator=generator, dtype=torch.float64)
    advantages = 4 * torch.randn(64, generator=generator, dtype=torch.float64)
    for clip_range in (1e-4, 0.2):
        got = clipped_policy_loss(new, old, advantages, clip_range).item()
        a = np.clip(advantages.numpy(), -5, 5)
        rho = np.exp(new.numpy() - old.numpy())
        expected = np.mean(np.maximum(-a * rho, -a * np.clip(rho, 1 - clip_range, 1 + clip_range)))
        assert got == pytest.approx(expected, rel=1e-12)
    # On policy (rho = 1) the loss is -mean(A) and its gradient is -A / N.
    new = old.clone().requires_grad_(True)
    clipped_policy_loss(new, old, advantages, 1e-4).backward()
    np.testing.assert_allclose(new.grad.numpy(), -np.clip(advantages.numpy(), -5, 5) / 64, rtol=1e-12)
