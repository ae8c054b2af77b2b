"""AWM's loss against its formula in float64 NumPy: the robust weighting, the advantage map, the
gradient's direction (good samples pulled in, bad ones pushed out) and its bound on the push."""

import numpy as np
import pytest
import torch

from rollout_client.awm import OFFSET, awm_loss, robust_weight, signed_advantages
from rollout_client.nft import noised, optimality


def test_awm_loss_is_its_formula():
    generator = torch.Generator().manual_seed(0)
    x, eps = (torch.randn(6, 16, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    levels = torch.tensor([0.05, 0.2, 0.4, 0.6, 0.8, 0.95], dtype=torch.float64)
    _, target = noised(x, eps, levels)
    v = target + 0.5 * torch.randn(6, 16, 4, generator=generator, dtype=torch.float64)
    advantages = torch.tensor([-1.0, -0.5, 0.0, 0.25, 0.7, 1.0], dtype=torch.float64)
    errors = ((v.numpy() - target.numpy()) ** 2).mean(axis=(1, 2))
    # float64 on both sides, the same operations summed in other orders: rounding of a few 1e-16
    # relative per term, far below rtol 1e-12.
    for power in (0.25, 0.5, 1.0):
        weight = levels.numpy() / power * ((errors + OFFSET) ** power - OFFSET**power)
        expected = (advantages.numpy() * weight).mean()
        assert awm_loss(v, target, levels, advantages, power).item() == pytest.approx(expected, rel=1e-12)
    # At p = 1 the weighting is s * l (less c^1 - c^1): the plain flow-matching error times the level.
    np.testing.assert_allclose(
        robust_weight(torch.from_numpy(errors), levels, 1.0).numpy(), levels.numpy() * errors, rtol=1e-12
    )


def test_awm_pulls_good_samples_in_pushes_bad_ones_out_and_bounds_the_push():
    """The gradient in v is (2 A s / (B E)) (l + c)^(p - 1) (v - v*): towards v* for A > 0, away for
    A < 0, none at A = 0; at p < 1 a sample further off gets a weaker push per unit of error."""
    target = torch.zeros(3, 8, dtype=torch.float64)
    levels = torch.full((3,), 0.5, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    v = torch.full((3, 8), 0.3, dtype=torch.float64, requires_grad=True)
    awm_loss(v, target, levels, advantages, 0.25).backward()
    error = 0.3**2
    scale = 2 * 0.5 * (error + OFFSET) ** (0.25 - 1) / (3 * 8)
    expected = scale * advantages.numpy()[:, None] * 0.3 * np.ones((3, 8))
    np.testing.assert_allclose(v.grad.numpy(), expected, rtol=1e-10)  # float64 autograd: ~1e-15 relative
    assert (v.grad[0] > 0).all() and (v.grad[1] < 0).all() and (v.grad[2] == 0).all()  # descent: -grad

    def push(distance: float, power: float) -> float:
        far = torch.full((1, 8), distance, dtype=torch.float64, requires_grad=True)
        awm_loss(far, target[:1], levels[:1], torch.tensor([-1.0], dtype=torch.float64), power).backward()
        return far.grad.abs().max().item() / distance  # per unit of error

    assert push(3.0, 0.25) < 0.1 * push(0.3, 0.25)  # robust: the far sample is hardly pushed
    assert push(3.0, 1.0) == pytest.approx(push(0.3, 1.0))  # plain: as hard at any distance


def test_signed_advantages_are_twice_the_optimality_less_one():
    advantages = torch.tensor([-5.0, -2.0, -1.0, 0.0, 0.5, 2.0, 9.0])
    # float32: r = 0.5 + 0.5 a rounds by at most half an ulp of 1 (3e-8), 2 r - 1 doubles that, exactly.
    np.testing.assert_allclose(
        signed_advantages(advantages).numpy(), (2 * optimality(advantages) - 1).numpy(), atol=1e-7
    )
    assert signed_advantages(advantages).tolist() == [-1.0, -1.0, -0.5, 0.0, 0.25, 1.0, 1.0]
    with pytest.raises(ValueError, match="must be positive"):
        signed_advantages(advantages, clip=0)
