"""Formula parity: every step type against an independent float64 NumPy reference of each formula."""

import math

import numpy as np
import pytest
import torch
from support import reference

from rollout_core import noise, steps


def flux_like_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    t = np.linspace(1.0, 1 / num_steps, num_steps)
    shifted = shift * t / (1 + (shift - 1) * t)
    return torch.tensor(np.append(shifted, 0.0), dtype=torch.float32)


CASES = [
    # (kind, seed, shape, noise level, num_steps)
    ("FLOW_SDE", 0, (2, 16, 8), 0.7, 10),
    ("FLOW_SDE", 1, (3, 64, 4), 0.3, 4),
    ("DANCE", 2, (2, 16, 8), 0.3, 10),
    ("DANCE", 3, (1, 4, 4, 4), 1.0, 6),
    ("CPS", 4, (2, 16, 8), 0.7, 10),
    ("CPS", 5, (4, 32, 2), 0.2, 3),
    ("ODE", 6, (2, 16, 8), 0.0, 5),
]


@pytest.mark.parametrize("kind, seed, shape, a, num_steps", CASES)
def test_step_matches_reference(kind, seed, shape, a, num_steps):
    sigmas = flux_like_sigmas(num_steps)
    generator = torch.Generator().manual_seed(seed)
    constants = steps.SAMPLERS[kind].log_prob_constants
    last = num_steps - 2 if kind == "CPS" else num_steps - 1  # CPS into sigma_T = 0 is deterministic
    for i in sorted({0, 1, last}):
        x = torch.randn(shape, generator=generator)
        v = torch.randn(shape, generator=generator)
        eps = torch.randn(shape, generator=generator)
        mean = steps.transition_mean(kind, x, v, sigmas, i, a)
        sd = steps.noise_std(kind, sigmas, i, a)
        x_next = mean + sd * eps
        ref_mean, ref_sd = reference.mean_and_sd(
            kind, x.double().numpy(), v.double().numpy(), sigmas.double().numpy(), i, a
        )
        ref_next = ref_mean + ref_sd * eps.double().numpy()
        assert sd.dtype == torch.float32 and mean.dtype == torch.float32
        assert sd.item() == pytest.approx(ref_sd, rel=1e-6, abs=1e-9)
        np.testing.assert_allclose(x_next.numpy(), ref_next, rtol=1e-5, atol=1e-5)
        if kind != "ODE":
            lp = steps.log_prob(sd * eps, sd, constants)
            assert lp.shape == (shape[0],)
            ref_lp = reference.log_prob(ref_next, ref_mean, ref_sd, constants)
            np.testing.assert_allclose(lp.numpy(), ref_lp, rtol=1e-5, atol=1e-5)


def test_flow_sde_first_step_uses_second_sigma():
    sigmas = flux_like_sigmas(8)
    assert sigmas[0].item() == 1.0
    expected = 0.7 * math.sqrt(1.0 / (1 - sigmas[1].item())) * math.sqrt(1.0 - sigmas[1].item())
    assert steps.noise_std("FLOW_SDE", sigmas, 0, 0.7).item() == pytest.approx(expected, rel=1e-6)

    # Wan's UniPC flow sigmas start just below 1: the first step takes the second sigma all the same,
    # where s / (1 - s) would give a noise std in the hundreds.
    wan = torch.tensor([1 - 1e-6, 0.9001, 0.7504, 0.5010, 0.0], dtype=torch.float32)
    s0, s1 = wan[0].item(), wan[1].item()
    expected = 0.7 * math.sqrt(s0 / (1 - s1)) * math.sqrt(s0 - s1)
    assert steps.noise_std("FLOW_SDE", wan, 0, 0.7).item() == pytest.approx(expected, rel=1e-5)
    assert steps.noise_std("FLOW_SDE", wan, 0, 0.7).item() < 1


def test_cps_into_zero_sigma_is_deterministic():
    sigmas = flux_like_sigmas(4)
    assert steps.noise_std("CPS", sigmas, 3, 0.7).item() == 0.0
    assert steps.noise_std("FLOW_SDE", sigmas, 3, 0.7).item() > 0.0


def test_log_prob_without_constants_is_negative_squared_residual():
    residual = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    lp = steps.log_prob(residual, torch.tensor(0.3), include_constants=False)
    np.testing.assert_allclose(lp.numpy(), [-(0.25 + 1.0) / 2, -4.0 / 2])


def test_seed_derivation_and_noise_rule():
    seeds = noise.derive_seeds(1234, 8)
    assert len(set(seeds)) == 8
    assert seeds[3] == noise.splitmix64(1234 + 3)
    # SplitMix64's published first output for state 0 (seed 0 -> first next() value).
    assert noise.splitmix64(0) == 0xE220A8397B1DCDAF
    # Stream j of a sample is a plain torch CPU generator draw with a documented seed.
    generator = torch.Generator("cpu").manual_seed(noise.noise_seed(seeds[0], 3))
    expected = torch.randn((5, 7), generator=generator)
    assert torch.equal(noise.step_noise(seeds[:1], 2, (5, 7))[0], expected)
    # Distinct streams and distinct samples draw distinct noise.
    draws = noise.draw(seeds[:2], 0, (16,))
    assert not torch.equal(draws[0], draws[1])
    assert not torch.equal(noise.initial_noise(seeds[:1], (16,)), noise.step_noise(seeds[:1], 0, (16,)))
