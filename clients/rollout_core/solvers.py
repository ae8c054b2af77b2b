r"""Deterministic solvers: the rule of every step that draws no noise, stateless per call.

Notation as in ``rollout_core.steps``: sigmas s_0 .. s_T (s_T = 0), step i from s = s_i to
s' = s_{i+1}, v the velocity after guidance at x = x_i. Flow matching is the diffusion
x = alpha x_data + s noise with alpha = 1 - s, so the velocity gives the data prediction
m_i = x_i - s_i v_i and the half log-SNR lambda = log(alpha / s) (-inf at s = 1, +inf at s = 0);
h = lambda(s') - lambda(s) > 0. All math is float32, as diffusers' schedulers run it.

* euler (``FlowMatchEulerDiscreteScheduler``): x' = x + (s' - s) v. Order 1.
* dpmpp_2m, DPM-Solver++(2M) with data prediction and the midpoint rule
  (``DPMSolverMultistepScheduler`` with ``use_flow_sigmas``, ``prediction_type="flow_prediction"``,
  ``solver_order=2`` and its defaults)::

      order 1:  x' = (s' / s) x - alpha' (e^-h - 1) m_i
      order 2:  r = h_{i-1} / h,
                x' = (s' / s) x - alpha' (e^-h - 1) m_i - 1/2 alpha' (e^-h - 1) (m_i - m_{i-1}) / r

  with h_{i-1} = lambda(s_i) - lambda(s_{i-1}). Order 2 wherever a data prediction of step i - 1
  exists, except the last step, into s_T = 0, which is first order (``final_sigmas_type="zero"``).
* unipc, UniPC-2 with B(h) = e^-h - 1 (``UniPCMultistepScheduler`` with ``use_flow_sigmas``,
  ``prediction_type="flow_prediction"``, ``solver_order=2``, ``solver_type="bh2"``, ``predict_x0``,
  ``lower_order_final``: Wan's). With phi = B = e^-h - 1 (h of the step at hand):

      predictor (UniP) from xc_i to x_{i+1}, order p = min(2, T - i, predictions available):
          p = 1:  x' = (s' / s) xc_i - alpha' phi m_i
          p = 2:  r = (lambda(s_{i-1}) - lambda(s_i)) / h,
                  x' = (s' / s) xc_i - alpha' phi m_i - alpha' B 1/2 (m_{i-1} - m_i) / r
      corrector (UniC), once m_i is known: x_i, the predictor's output from xc_{i-1} (at s_{i-1}),
      becomes xc_i, with h = lambda(s_i) - lambda(s_{i-1}) and q the order of step i - 1:
          g_1 = phi / (-h) - 1, b_1 = g_1 / B, g_2 = g_1 / (-h) - 1/2, b_2 = 2 g_2 / B
          q = 1:  rho_c = 1/2, D = 0
          q = 2:  r = (lambda(s_{i-2}) - lambda(s_{i-1})) / h, D = (m_{i-2} - m_{i-1}) / r,
                  (rho_0, rho_c) solves [[1, 1], [r, 1]] rho = (b_1, b_2)
          xc_i = (s_i / s_{i-1}) xc_{i-1} - alpha_i phi m_{i-1} - alpha_i B (rho_0 D + rho_c (m_i - m_{i-1}))

  The predictor steps from the corrected sample, while x_i, what the transformer saw, is what the
  stream carries. rho is solved as diffusers solves it (``torch.linalg.solve``), so the numbers are
  its own; where the schedule starts at s = 1 (lambda = -inf) r is infinite, the system has no finite
  solution, and the step takes its limit rho = (0, b_1): the term of s = 1 drops out.

The stochastic steps stay the first-order Gaussian transitions of ``rollout_core.steps``, from x_i
as streamed (no correction first), so a trainer replays them from the stream alone. A stochastic
step ends the history (``History``): its noise moves the sample onto another ODE trajectory, whose
earlier data predictions the history does not hold, so the deterministic steps after a stochastic
window start the solver again as at x_0 (first order, no corrector, then its warm-up). Carrying the
predictions across the noise instead costs accuracy: after a 2-step SDE window, dpmpp_2m with them
was 5 times further from the converged latents than Euler at 4 steps, and without them 2 times
closer (bench/solvers.py, tiny-flux). The predictions held are those of the last two deterministic
steps; ``History.rows`` re-forms them with the rows (tree forks and prunes), and every rank of a
sequence-parallel server holds the same.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollout.v1 import rollout_pb2
from rollout_core.steps import euler_mean


@dataclass(frozen=True)
class History:
    """What a deterministic solver carries from step to step: row b of each tensor [B, ...] belongs
    to row b of the latents (float32)."""

    predictions: tuple[torch.Tensor, ...] = ()  # m_j of the last steps j < i, oldest first
    corrected: torch.Tensor | None = None  # unipc: xc_{i-1}, when step i - 1 was its predictor step
    order: int = 0  # the order of step i - 1

    def rows(self, index: torch.Tensor) -> "History":
        """The history of the rows ``index`` (a row listed twice is copied)."""
        return History(
            tuple(m[index] for m in self.predictions),
            None if self.corrected is None else self.corrected[index],
            self.order,
        )


@dataclass(frozen=True)
class SolverStep:
    """What a deterministic step did."""

    x_next: torch.Tensor
    history: History  # for step i + 1
    order: int


def _lambda(s: torch.Tensor) -> torch.Tensor:
    return torch.log(1 - s) - torch.log(s)


def data_prediction(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> torch.Tensor:
    """m_i = x_i - s_i v_i."""
    return x - sigmas[i].to(x.device) * v


def _euler(x, v, m, sigmas, i, history, order) -> tuple[torch.Tensor, None]:
    return euler_mean(x, v, sigmas, i), None


def _dpmpp_2m(x, v, m, sigmas, i, history, order) -> tuple[torch.Tensor, None]:
    s, s_next = sigmas[i], sigmas[i + 1]
    h = _lambda(s_next) - _lambda(s)
    coefficient = (1 - s_next) * (torch.exp(-h) - 1.0)
    # The operations and their order are DPMSolverMultistepScheduler's.
    x_next = (s_next / s).to(x.device) * x - coefficient.to(x.device) * m
    if order == 2:
        r = (_lambda(s) - _lambda(sigmas[i - 1])) / h
        d1 = (1.0 / r).to(x.device) * (m - history.predictions[-1])
        x_next = x_next - (0.5 * coefficient).to(x.device) * d1
    return x_next, None


def _unipc_update(x, m, earlier, sigmas, i, order) -> torch.Tensor:
    """UniPC's shared update from x at s_i to s_{i+1}, with its order-2 difference to ``earlier``
    (m_{i-1}): the predictor's form (rho = 1/2)."""
    s, s_next = sigmas[i], sigmas[i + 1]
    h = _lambda(s_next) - _lambda(s)
    phi = torch.expm1(-h)
    alpha_next = 1 - s_next
    x_next = (s_next / s).to(x.device) * x - (alpha_next * phi).to(x.device) * m
    if order == 2:
        r = (_lambda(sigmas[i - 1]) - _lambda(s)) / h
        d1 = (earlier - m) / r.to(x.device)
        x_next = x_next - (alpha_next * phi).to(x.device) * (0.5 * d1)
    return x_next


def _unipc_corrector(x, m, history: History, sigmas, i) -> torch.Tensor:
    """xc_i from xc_{i-1} = ``history.corrected``, x_i's predictor step corrected with m_i."""
    s, s_prev = sigmas[i], sigmas[i - 1]
    h = _lambda(s) - _lambda(s_prev)
    phi = torch.expm1(-h)  # B(h) of bh2 is the same number
    g1 = phi / -h - 1
    b1 = g1 / phi
    m_prev = history.predictions[-1]
    last, alpha = history.corrected, (1 - s).to(x.device)
    x_c = (s / s_prev).to(x.device) * last - (alpha * phi.to(x.device)) * m_prev
    if history.order == 1:
        return x_c - (alpha * phi.to(x.device)) * (0.5 * (m - m_prev))
    b2 = (g1 / -h - 0.5) * 2 / phi
    r = (_lambda(sigmas[i - 2]) - _lambda(s_prev)) / h
    if torch.isinf(r):
        rho_0, rho_c = torch.zeros(()), b1
    else:
        ones = torch.ones(())
        rho_0, rho_c = torch.linalg.solve(
            torch.stack([torch.stack([ones, ones]), torch.stack([r, ones])]), torch.stack([b1, b2])
        )
    d1 = (history.predictions[-2] - m_prev) / r.to(x.device)
    return x_c - (alpha * phi.to(x.device)) * (rho_0.to(x.device) * d1 + rho_c.to(x.device) * (m - m_prev))


def _unipc(x, v, m, sigmas, i, history, order) -> tuple[torch.Tensor, torch.Tensor]:
    corrected = x if history.corrected is None else _unipc_corrector(x, m, history, sigmas, i)
    earlier = history.predictions[-1] if order == 2 else None
    return _unipc_update(corrected, m, earlier, sigmas, i, order), corrected


def _first_order(i: int, num_steps: int, known: int) -> int:
    return 1


def _dpmpp_2m_order(i: int, num_steps: int, known: int) -> int:
    return 2 if known and i < num_steps - 1 else 1


def _unipc_order(i: int, num_steps: int, known: int) -> int:
    return min(2, num_steps - i, known + 1)


@dataclass(frozen=True)
class Solver:
    """One deterministic solver: its name and rollout.v1 ``Solver``, the diffusers scheduler whose
    step it is with the settings that make it so, how many data predictions it reads back, its order
    at step i of T given the predictions known, and its step (x, v, m_i, sigmas, i, history, order)
    -> (x_{i+1}, xc_i or None)."""

    name: str
    enum: int
    scheduler_class: str
    scheduler_settings: dict[str, Any]
    history_length: int
    order_at: Callable[[int, int, int], int]
    step: Callable


SOLVERS = {
    solver.name: solver
    for solver in (
        Solver(
            name="euler",
            enum=rollout_pb2.SOLVER_EULER,
            scheduler_class="FlowMatchEulerDiscreteScheduler",
            scheduler_settings={"stochastic_sampling": False},
            history_length=0,
            order_at=_first_order,
            step=_euler,
        ),
        Solver(
            name="dpmpp_2m",
            enum=rollout_pb2.SOLVER_DPMPP_2M,
            scheduler_class="DPMSolverMultistepScheduler",
            scheduler_settings={
                "algorithm_type": "dpmsolver++",
                "solver_order": 2,
                "solver_type": "midpoint",
                "prediction_type": "flow_prediction",
                "use_flow_sigmas": True,
                "final_sigmas_type": "zero",
                "thresholding": False,
            },
            history_length=1,
            order_at=_dpmpp_2m_order,
            step=_dpmpp_2m,
        ),
        Solver(
            name="unipc",
            enum=rollout_pb2.SOLVER_UNIPC,
            scheduler_class="UniPCMultistepScheduler",
            scheduler_settings={
                "solver_order": 2,
                "solver_type": "bh2",
                "predict_x0": True,
                "lower_order_final": True,
                "prediction_type": "flow_prediction",
                "use_flow_sigmas": True,
                "disable_corrector": [],
                "thresholding": False,
            },
            history_length=2,
            order_at=_unipc_order,
            step=_unipc,
        ),
    )
}
# The same solvers by their rollout.v1 Solver.
SOLVERS_BY_ENUM = {solver.enum: solver for solver in SOLVERS.values()}
# The solver of a pipeline whose scheduler is none of the above.
FALLBACK_SOLVER = "euler"


def solver_named(name: str) -> Solver:
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; expected one of {list(SOLVERS)}") from None


def solver_of_scheduler(scheduler_class: str, config: Mapping[str, Any]) -> str:
    """The solver whose step is that of a diffusers scheduler of class ``scheduler_class`` and
    ``config``; Euler where none is."""
    for solver in SOLVERS.values():
        settings = solver.scheduler_settings.items()
        if solver.scheduler_class == scheduler_class and all(config.get(k) == v for k, v in settings):
            return solver.name
    return FALLBACK_SOLVER


def step_orders(name: str, stochastic: list[bool]) -> list[int]:
    """The order of every step of a rollout: 1 on a stochastic step, the solver's elsewhere, which
    knows the data predictions of the deterministic steps since the last stochastic one (at most its
    history length)."""
    solver, orders, known = solver_named(name), [], 0
    for i, noisy in enumerate(stochastic):
        orders.append(1 if noisy else solver.order_at(i, len(stochastic), known))
        known = 0 if noisy else min(known + 1, solver.history_length)
    return orders


def solver_step(
    name: str, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, history: History
) -> SolverStep:
    """Deterministic step i from x = x_i with velocity v (float32, on x's device; sigmas on the CPU)."""
    solver = solver_named(name)
    x, v, sigmas = x.float(), v.float(), sigmas.to(torch.float32).cpu()
    m = data_prediction(x, v, sigmas, i) if solver.history_length else None  # Euler reads none
    order = solver.order_at(i, len(sigmas) - 1, len(history.predictions))
    x_next, corrected = solver.step(x, v, m, sigmas, i, history, order)
    return SolverStep(x_next, _added(solver, history, m, corrected, order), order)


def _added(solver: Solver, history: History, m: torch.Tensor | None, corrected, order: int) -> History:
    if not solver.history_length:
        return History()
    return History((*history.predictions, m)[-solver.history_length :], corrected, order)
