r"""Flow-matching transitions x_i -> x_{i+1} and their log-probabilities.

Notation: sigmas s_0 .. s_T (s_T = 0), step i with s = s_i, s' = s_{i+1}, dt = s' - s < 0,
v = velocity after guidance, x = x_i, a = noise level. All math is float32 whatever the model dtype.

* FLOW_SDE (FlowGRPO)::

      std_t = a * sqrt(s / (1 - s_hat)),   s_hat = s_1 if s == 1 else s
      mean  = x * (1 + std_t^2 / (2 s) * dt) + v * (1 + std_t^2 * (1 - s) / (2 s)) * dt
      sd    = std_t * sqrt(-dt)

* DANCE (DanceGRPO): the FLOW_SDE mean with std_t = a, and sd = a * sqrt(-dt).
* CPS (coefficients-preserving sampling)::

      sd   = s' * sin(a * pi / 2)
      x0   = x - s v,   x1 = x + (1 - s) v
      mean = (1 - s') x0 + sqrt(s'^2 - sd^2) x1

* ODE: mean = x + dt * v, sd = 0.

A stochastic step draws x' = mean + sd * eps with eps ~ N(0, I). Its per-sample log-probability is
the mean over all non-batch elements of::

    -(x' - mean)^2 / (2 sd^2) - log(sd) - log(sqrt(2 pi))      (with constants)
    -(x' - mean)^2                                             (without: FlowGRPO's CPS convention)

A step whose sd is 0 (ODE, or CPS into s_T = 0) is deterministic and has no log-probability.
"""

import math

import torch

SAMPLER_TYPES = ("FLOW_SDE", "DANCE", "CPS", "ODE")
# FlowGRPO's conventions: the SDE samplers score the full Gaussian density, CPS drops the constants.
DEFAULT_LOG_PROB_CONSTANTS = {"FLOW_SDE": True, "DANCE": True, "CPS": False, "ODE": False}
# The largest noise level each sampler takes. CPS: sd = s' sin(a pi / 2) must stay <= s', and past
# a = 1 the sine falls again. The SDE samplers take FlowGRPO's larger settings (1.2 for Qwen-Image,
# up to 1.5 for editing models) with room to spare; ODE ignores the level.
MAX_NOISE_LEVELS = {"FLOW_SDE": 3.0, "DANCE": 3.0, "CPS": 1.0, "ODE": 3.0}
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _sde_std_t(kind: str, sigmas: torch.Tensor, i: int, noise_level: float) -> torch.Tensor:
    a = _scalar(noise_level)
    if kind == "DANCE":
        return a
    s = sigmas[i]
    s_hat = sigmas[1] if s.item() == 1.0 else s
    return a * torch.sqrt(s / (1 - s_hat))


def noise_std(kind: str, sigmas: torch.Tensor, i: int, noise_level: float) -> torch.Tensor:
    """The transition's noise standard deviation sd (a float32 0-d tensor; 0 means deterministic)."""
    sigmas = sigmas.to(torch.float32).cpu()
    s, s_next = sigmas[i], sigmas[i + 1]
    if kind == "ODE":
        return _scalar(0.0)
    if kind in ("FLOW_SDE", "DANCE"):
        return _sde_std_t(kind, sigmas, i, noise_level) * torch.sqrt(s - s_next)
    if kind == "CPS":
        return s_next * torch.sin(_scalar(noise_level) * (math.pi / 2))
    raise ValueError(f"unknown sampler type {kind!r}; expected one of {SAMPLER_TYPES}")


def transition_mean(
    kind: str, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, noise_level: float
) -> torch.Tensor:
    """The mean of x_{i+1} given x_i = x and velocity v (float32, on x's device)."""
    sigmas = sigmas.to(torch.float32).cpu()
    x, v = x.float(), v.float()
    s, s_next = sigmas[i], sigmas[i + 1]
    dt = s_next - s
    if kind == "ODE":
        return x + dt.to(x.device) * v
    if kind in ("FLOW_SDE", "DANCE"):
        std_t = _sde_std_t(kind, sigmas, i, noise_level)
        x_coef = 1 + std_t**2 / (2 * s) * dt
        v_coef = (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        return x * x_coef.to(x.device) + v * v_coef.to(x.device)
    if kind == "CPS":
        sd = noise_std(kind, sigmas, i, noise_level)
        x0 = x - s.to(x.device) * v
        x1 = x + (1 - s).to(x.device) * v
        return (1 - s_next).to(x.device) * x0 + torch.sqrt(s_next**2 - sd**2).to(x.device) * x1
    raise ValueError(f"unknown sampler type {kind!r}; expected one of {SAMPLER_TYPES}")


def log_prob(residual: torch.Tensor, sd: torch.Tensor, include_constants: bool) -> torch.Tensor:
    """Per-sample log-probability [B] of a Gaussian step with residual x' - mean and std ``sd``."""
    residual = residual.float()
    sd = sd.to(device=residual.device, dtype=torch.float32)
    if include_constants:
        # (residual / sd)^2 rather than residual^2 / sd^2: no underflow for tiny noise levels.
        elementwise = -((residual / sd) ** 2) / 2 - torch.log(sd) - _LOG_SQRT_2PI
    else:
        elementwise = -(residual**2)
    return elementwise.mean(dim=tuple(range(1, residual.ndim)))
