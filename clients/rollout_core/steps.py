r"""Flow-matching transitions x_i -> x_{i+1} and their log-probabilities.

Notation: sigmas s_0 .. s_T (s_T = 0), step i with s = s_i, s' = s_{i+1}, dt = s' - s < 0,
v = velocity after guidance, x = x_i, a = noise level. All math is float32 whatever the model dtype.

* FLOW_SDE (FlowGRPO)::

      std_t = a * sqrt(s / (1 - s_hat)),   s_hat = s_1 at the first step (i = 0), else s
      mean  = x * (1 + std_t^2 / (2 s) * dt) + v * (1 + std_t^2 * (1 - s) / (2 s)) * dt
      sd    = std_t * sqrt(-dt)

* DANCE (DanceGRPO): the FLOW_SDE mean with std_t = a, and sd = a * sqrt(-dt).
* CPS (coefficients-preserving sampling)::

      sd   = s' * sin(a * pi / 2)
      x0   = x - s v,   x1 = x + (1 - s) v
      mean = (1 - s') x0 + sqrt(s'^2 - sd^2) x1

* ODE: no step draws noise; every step is the request's deterministic solver's
  (``rollout_core.solvers``), whose first-order member, Euler, is mean = x + dt * v, sd = 0.

A stochastic step draws x' = mean + sd * eps with eps ~ N(0, I). Its per-sample log-probability is
the mean over all non-batch elements of::

    -(x' - mean)^2 / (2 sd^2) - log(sd) - log(sqrt(2 pi))      (with constants)
    -(x' - mean)^2                                             (without: FlowGRPO's CPS convention)

A sample with several latent streams (``rollout_core.latent_streams``) is one joint vector: its
log-probability is the mean over all elements of all streams, and ``stream_log_probs`` gives each
stream's own mean beside it.

A step whose sd is 0 (ODE, or CPS into s_T = 0), and a step left out of the request's stochastic
steps, is deterministic, has no log-probability, and takes the request's solver.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_core import latent_streams

if TYPE_CHECKING:
    from rollout_core.latent_streams import LatentStream

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _flow_sde_std_t(sigmas: torch.Tensor, i: int, noise_level: float) -> torch.Tensor:
    s = sigmas[i]
    # FlowGRPO takes s_1 where s == 1 (the first step) to stay finite. Wan's UniPC schedule starts just
    # below 1 (1 - 1e-6), where s / (1 - s) is as singular: the first step takes s_1 whatever s_0 is.
    s_hat = sigmas[1] if i == 0 else s
    return _scalar(noise_level) * torch.sqrt(s / (1 - s_hat))


def _dance_std_t(sigmas: torch.Tensor, i: int, noise_level: float) -> torch.Tensor:
    return _scalar(noise_level)


def _sde_mean(std_t_of: Callable) -> Callable:
    """The SDE mean with the sampler's std_t."""

    def mean(x, v, sigmas, i, noise_level) -> torch.Tensor:
        s, s_next = sigmas[i], sigmas[i + 1]
        dt = s_next - s
        std_t = std_t_of(sigmas, i, noise_level)
        x_coef = 1 + std_t**2 / (2 * s) * dt
        v_coef = (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        return x * x_coef.to(x.device) + v * v_coef.to(x.device)

    return mean


def _sde_sd(std_t_of: Callable) -> Callable:
    """sd = std_t * sqrt(-dt) with the sampler's std_t."""

    def sd(sigmas, i, noise_level) -> torch.Tensor:
        return std_t_of(sigmas, i, noise_level) * torch.sqrt(sigmas[i] - sigmas[i + 1])

    return sd


def _cps_sd(sigmas, i, noise_level) -> torch.Tensor:
    return sigmas[i + 1] * torch.sin(_scalar(noise_level) * (math.pi / 2))


def _cps_mean(x, v, sigmas, i, noise_level) -> torch.Tensor:
    s, s_next = sigmas[i], sigmas[i + 1]
    sd = _cps_sd(sigmas, i, noise_level)
    x0 = x - s.to(x.device) * v
    x1 = x + (1 - s).to(x.device) * v
    return (1 - s_next).to(x.device) * x0 + torch.sqrt(s_next**2 - sd**2).to(x.device) * x1


def _ode_sd(sigmas, i, noise_level) -> torch.Tensor:
    return _scalar(0.0)


def euler_mean(x, v, sigmas, i, noise_level=0.0) -> torch.Tensor:
    """x + dt * v: the ODE step of the Euler solver."""
    return x + (sigmas[i + 1] - sigmas[i]).to(x.device) * v


@dataclass(frozen=True)
class Sampler:
    """One transition rule: its name and its rollout.v1 ``SamplerType``, its mean and noise std
    (float32; sigmas on the CPU), FlowGRPO's log-prob convention for it, the largest noise level it
    takes, and whether it has stochastic steps at all."""

    name: str
    enum: int
    mean: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
    sd: Callable[[torch.Tensor, int, float], torch.Tensor]
    log_prob_constants: bool  # the default: SDE samplers score the full density, CPS drops constants
    max_noise_level: float
    stochastic: bool = True


# The largest noise levels: CPS's sd = s' sin(a pi / 2) must stay <= s', and past a = 1 the sine
# falls again; the SDE samplers take FlowGRPO's larger settings (1.2 for Qwen-Image, up to 1.5 for
# editing models) with room to spare; ODE ignores the level.
SAMPLERS = {
    sampler.name: sampler
    for sampler in (
        Sampler(
            name="FLOW_SDE",
            enum=rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
            mean=_sde_mean(_flow_sde_std_t),
            sd=_sde_sd(_flow_sde_std_t),
            log_prob_constants=True,
            max_noise_level=3.0,
        ),
        Sampler(
            name="DANCE",
            enum=rollout_pb2.SAMPLER_TYPE_DANCE,
            mean=_sde_mean(_dance_std_t),
            sd=_sde_sd(_dance_std_t),
            log_prob_constants=True,
            max_noise_level=3.0,
        ),
        Sampler(
            name="CPS",
            enum=rollout_pb2.SAMPLER_TYPE_CPS,
            mean=_cps_mean,
            sd=_cps_sd,
            log_prob_constants=False,
            max_noise_level=1.0,
        ),
        Sampler(
            name="ODE",
            enum=rollout_pb2.SAMPLER_TYPE_ODE,
            mean=euler_mean,
            sd=_ode_sd,
            log_prob_constants=False,
            max_noise_level=3.0,
            stochastic=False,
        ),
    )
}
# The same samplers by their rollout.v1 SamplerType.
SAMPLERS_BY_ENUM = {sampler.enum: sampler for sampler in SAMPLERS.values()}
# The sampler of a request that names none (SAMPLER_TYPE_UNSPECIFIED).
DEFAULT_SAMPLER = SAMPLERS["FLOW_SDE"]


def sampler_named(kind: str) -> Sampler:
    try:
        return SAMPLERS[kind]
    except KeyError:
        raise ValueError(f"unknown sampler type {kind!r}; expected one of {list(SAMPLERS)}") from None


def noise_std(kind: str, sigmas: torch.Tensor, i: int, noise_level: float) -> torch.Tensor:
    """The transition's noise standard deviation sd (a float32 0-d tensor; 0 means deterministic)."""
    return sampler_named(kind).sd(sigmas.to(torch.float32).cpu(), i, noise_level)


def transition_mean(
    kind: str, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, noise_level: float
) -> torch.Tensor:
    """The mean of x_{i+1} given x_i = x and velocity v (float32, on x's device)."""
    return sampler_named(kind).mean(x.float(), v.float(), sigmas.to(torch.float32).cpu(), i, noise_level)


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


def stream_log_probs(
    residual: torch.Tensor, sd: torch.Tensor, include_constants: bool, streams: Sequence["LatentStream"]
) -> dict[str, torch.Tensor]:
    """Each latent stream's own log-probability [B] of a joint step: the mean over its elements alone."""
    parts = latent_streams.split(residual, streams)
    return {
        stream.name: log_prob(part, sd, include_constants)
        for stream, part in zip(streams, parts, strict=True)
    }
