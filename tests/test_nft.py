"""The DiffusionNFT helpers: the loss and its on-policy gradient against their formulas (float64
NumPy), the optimality map, and velocities that are the served transformer's: an ODE rollout's
streamed step x_i -> x_{i+1} is an Euler step along them, at the schedule's own noise levels."""

import numpy as np
import pytest
import torch
from support.parity import TOLERANCE
from support.requests import make_request

from rollout.v1 import rollout_pb2
from rollout_client.nft import (
    anchor_loss,
    final_latents,
    nft_loss,
    nft_x0_loss,
    noise_levels,
    noised,
    optimality,
    velocities,
)


def test_nft_loss_is_its_formula_and_pulls_good_samples_in_and_pushes_bad_ones_out():
    generator = torch.Generator().manual_seed(0)
    v_old, target = (torch.randn(6, 16, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    v = v_old + 0.1 * torch.randn(6, 16, 4, generator=generator, dtype=torch.float64)
    r = torch.tensor([0.0, 0.2, 0.5, 0.5, 0.9, 1.0], dtype=torch.float64)
    for beta in (1.0, 0.1):
        plus, minus = (
            (1 - beta) * v_old.numpy() + beta * v.numpy(),
            (1 + beta) * v_old.numpy() - beta * v.numpy(),
        )
        per_sample = r.numpy() * ((plus - target.numpy()) ** 2).mean(axis=(1, 2)) + (1 - r.numpy()) * (
            (minus - target.numpy()) ** 2
        ).mean(axis=(1, 2))
        assert nft_loss(v, v_old, target, r, beta).item() == pytest.approx(per_sample.mean(), rel=1e-12)
    # At v = v_old the gradient is 2 beta (2r - 1) (v - v*) / (B E): r = 1 is flow matching on the
    # sample, r = 0 its opposite, r = 0.5 nothing.
    beta = 0.5
    v = v_old.clone().requires_grad_(True)
    nft_loss(v, v_old, target, r, beta).backward()
    expected = 2 * beta * (2 * r.numpy() - 1)[:, None, None] * (v_old - target).numpy() / (6 * 16 * 4)
    np.testing.assert_allclose(v.grad.numpy(), expected, rtol=1e-10, atol=1e-15)


def test_nft_x0_loss_is_the_velocity_error_weighted_by_its_own_size():
    """Against its velocity form (x0 - x = s (v* - v), float64 NumPy): each sample's term is
    s^2 mean((v - v*)^2) / max(s mean(|v - v*|), 1e-5), and the weight carries no gradient."""
    generator = torch.Generator().manual_seed(0)
    x, eps = (torch.randn(6, 16, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    levels = torch.tensor([0.05, 0.2, 0.4, 0.6, 0.8, 0.95], dtype=torch.float64)
    x_s, target = noised(x, eps, levels)
    v_old = target + 0.3 * torch.randn(6, 16, 4, generator=generator, dtype=torch.float64)
    v = v_old + 0.1 * torch.randn(6, 16, 4, generator=generator, dtype=torch.float64)
    r = torch.tensor([0.0, 0.2, 0.5, 0.5, 0.9, 1.0], dtype=torch.float64)
    s = levels.numpy().reshape(-1, 1, 1)

    def term(prediction: np.ndarray) -> np.ndarray:
        error = prediction - target.numpy()
        return (
            s.ravel() ** 2
            * (error**2).mean(axis=(1, 2))
            / np.maximum(s.ravel() * np.abs(error).mean(axis=(1, 2)), 1e-5)
        )

    for beta in (1.0, 0.1):
        plus = (1 - beta) * v_old.numpy() + beta * v.numpy()
        minus = (1 + beta) * v_old.numpy() - beta * v.numpy()
        expected = ((r.numpy() * term(plus) + (1 - r.numpy()) * term(minus)) / beta).mean()
        # float64: x_s - s v - x rounds x_s - x = s v* at ~2.2e-16 |x| (|x| < 5) against errors of
        # s |v - v*| >= 0.05 * 1e-2: a relative 1e-11 at worst per element, less in the means.
        assert nft_x0_loss(v, v_old, x_s, x, levels, r, beta).item() == pytest.approx(expected, rel=1e-10)
    # At v = v_old the gradient is 2 s (2r - 1) (v - v*) / (B E mean|v - v*|): the pull of every
    # sample is about s whatever its error's size; a weight with a gradient would change it.
    beta = 0.5
    at_old = v_old.clone().requires_grad_(True)
    nft_x0_loss(at_old, v_old, x_s, x, levels, r, beta).backward()
    error = v_old.numpy() - target.numpy()
    scale = np.abs(error).mean(axis=(1, 2), keepdims=True)
    expected_grad = 2 * s * (2 * r.numpy().reshape(-1, 1, 1) - 1) * error / (6 * 64 * scale)
    # Relative 1e-10 as above; at r = 0.5 the positive and negative halves, each below
    # s |v - v*| / (B E mean|v - v*|) < 1e-2 in size, cancel to 0 only up to their relative 1e-13
    # rounding (x_s - s v_pm - x carries 1e-15 against errors of at least 1e-2): atol 1e-15.
    np.testing.assert_allclose(at_old.grad.numpy(), expected_grad, rtol=1e-10, atol=1e-15)


def test_anchor_loss_is_the_mean_squared_velocity_distance_and_pulls_towards_the_reference():
    generator = torch.Generator().manual_seed(1)
    v, v_reference = (torch.randn(6, 16, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    v.requires_grad_(True)
    loss = anchor_loss(v, v_reference)
    difference = v.detach().numpy() - v_reference.numpy()
    # float64 sums of 384 squares below 50 each: relative rounding far below 1e-12.
    assert loss.item() == pytest.approx((difference**2).mean(axis=(1, 2)).mean(), rel=1e-12)
    loss.backward()
    np.testing.assert_allclose(v.grad.numpy(), 2 * difference / difference.size, rtol=1e-12)


def test_optimality_is_one_half_at_the_mean_and_saturates_at_the_clip():
    advantages = torch.tensor([-5.0, -2.0, -1.0, 0.0, 1.0, 2.0, 5.0])
    np.testing.assert_allclose(optimality(advantages).numpy(), [0, 0, 0.25, 0.5, 0.75, 1, 1])
    np.testing.assert_allclose(optimality(advantages, clip=1.0).numpy(), [0, 0, 0, 0.5, 1, 1, 1])
    with pytest.raises(ValueError, match="must be positive"):
        optimality(advantages, clip=0.0)


def test_noised_is_the_flow_matching_interpolation():
    generator = torch.Generator().manual_seed(1)
    x, eps = torch.randn(3, 8, 4, generator=generator), torch.randn(3, 8, 4, generator=generator)
    levels = torch.tensor([0.0, 0.25, 1.0])
    x_s, target = noised(x, eps, levels)
    torch.testing.assert_close(x_s[0], x[0])
    torch.testing.assert_close(x_s[1], 0.75 * x[1] + 0.25 * eps[1])
    torch.testing.assert_close(x_s[2], eps[2])
    torch.testing.assert_close(target, eps - x)
    drawn = noise_levels(10_000, torch.Generator().manual_seed(0))
    assert drawn.min() > 0 and drawn.max() < 1 and abs(drawn.mean().item() - 0.5) < 0.01


def test_velocities_are_the_served_ones_at_the_schedules_noise_levels(client, tiny_transformer):
    request = make_request(
        {"prompts": ["a red fox", "two cats"], "samples_per_prompt": 2, "base_seed": 3, "num_steps": 4},
        {"height": 64, "width": 64, "images": False, "sampler": rollout_pb2.SAMPLER_TYPE_ODE},
        {"latents": rollout_pb2.LATENT_SELECTION_ALL},
    )
    trajectories = client.rollout(request)
    assert trajectories[0].transformer_call.guidance_rule == "none"  # the positive branch is the step's
    torch.testing.assert_close(
        final_latents(trajectories), torch.stack([t.latents[-1] for t in trajectories])
    )
    with torch.no_grad():
        for i in range(4):
            x = torch.stack([t.latents[i] for t in trajectories])
            levels = torch.stack([t.sigmas[i] for t in trajectories])
            step = torch.stack([t.sigmas[i + 1] - t.sigmas[i] for t in trajectories]).view(-1, 1, 1)
            streamed = torch.stack([t.latents[i + 1] for t in trajectories])
            euler = x + step * velocities(tiny_transformer, trajectories, x, levels)
            torch.testing.assert_close(euler, streamed, atol=TOLERANCE, rtol=0)


def test_final_latents_need_the_last_latent_streamed(client):
    request = make_request(
        {"prompts": ["a red fox"], "num_steps": 2, "height": 64, "width": 64, "images": False},
        {"latents": rollout_pb2.LATENT_SELECTION_NONE},
    )
    with pytest.raises(ValueError, match="sample 0 has no final latent"):
        final_latents(client.rollout(request))


def test_noise_levels_above_a_minimum_are_the_logit_normal_draw_mapped_into_it():
    plain = noise_levels(1000, torch.Generator().manual_seed(3))
    high = noise_levels(1000, torch.Generator().manual_seed(3), minimum=0.5)
    assert torch.allclose(high, 0.5 + 0.5 * plain) and bool((high >= 0.5).all() and (high < 1).all())
    assert torch.equal(plain, torch.sigmoid(torch.randn(1000, generator=torch.Generator().manual_seed(3))))
