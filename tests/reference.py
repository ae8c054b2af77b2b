"""Independent float64 NumPy reference of the step formulas in DESIGN §3 (shares no code with the
sampler)."""

import math

import numpy as np


def mean_and_sd(kind: str, x: np.ndarray, v: np.ndarray, sigmas: np.ndarray, i: int, a: float):
    s, s1 = float(sigmas[i]), float(sigmas[i + 1])
    dt = s1 - s
    if kind in ("FLOW_SDE", "DANCE"):
        if kind == "FLOW_SDE":
            s_hat = float(sigmas[1]) if s == 1.0 else s
            std_t = a * math.sqrt(s / (1 - s_hat))
        else:
            std_t = a
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        return mean, std_t * math.sqrt(-dt)
    if kind == "CPS":
        sd = s1 * math.sin(a * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return (1 - s1) * x0 + math.sqrt(s1**2 - sd**2) * x1, sd
    return x + dt * v, 0.0


def log_prob(x_next: np.ndarray, mean: np.ndarray, sd: float, constants: bool) -> np.ndarray:
    axes = tuple(range(1, x_next.ndim))
    squared = (x_next - mean) ** 2
    if constants:
        return (-squared / (2 * sd**2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))).mean(axes)
    return (-squared).mean(axes)
