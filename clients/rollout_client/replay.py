"""Recompute a trajectory's steps the way a trainer does: the log-probs of its stochastic steps from
the model (the policy update), and its deterministic steps from velocities (a check of the solver)."""

from typing import TYPE_CHECKING

import torch

from rollout_client.grpo import Transformer, step_log_probs, step_transitions
from rollout_core import solvers

if TYPE_CHECKING:
    from rollout_client.trajectory import Trajectory


@torch.no_grad()
def replay_log_probs(
    transformer: Transformer, trajectory: "Trajectory", device: str | torch.device = "cpu"
) -> torch.Tensor:
    """float32 [T]: the log-prob of each stochastic step recomputed with ``transformer``; NaN elsewhere.

    For step i: v = guidance(transformer(x_i, t_i, **env)), mean = transition mean, and the streamed
    x_{i+1} is scored under N(mean, sd^2) (``grpo.step_log_probs`` on this one trajectory, without
    gradients). Needs x_i and x_{i+1} of every stochastic step (the ALL or AROUND_STOCHASTIC latent
    selections). Wan 2.2: pass both experts by component name, and each step replays on the one that
    ran it.
    """
    replayed = torch.full((trajectory.num_steps,), float("nan"))
    for i in torch.nonzero(trajectory.stochastic).flatten().tolist():
        replayed[i] = step_log_probs(transformer, [trajectory], i, device).item()
    return replayed


@torch.no_grad()
def replay_stream_log_probs(
    transformer: Transformer, trajectory: "Trajectory", device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """A sample with several latent streams (LTX-2): each stream's own log-prob of each stochastic
    step recomputed with ``transformer``, float32 [T] by stream name (NaN elsewhere), as the stream's
    ``stream_log_probs``: for a trainer that weighs the streams otherwise than the joint log-prob."""
    replayed = {
        stream.name: torch.full((trajectory.num_steps,), float("nan")) for stream in trajectory.streams
    }
    for i in torch.nonzero(trajectory.stochastic).flatten().tolist():
        for name, values in step_transitions(transformer, [trajectory], i, device).stream_log_probs.items():
            replayed[name][i] = values.item()
    return replayed


@torch.no_grad()
def regenerate_deterministic_steps(trajectory: "Trajectory", velocities: torch.Tensor) -> torch.Tensor:
    """float32 [T, ...]: x_{i+1} of every deterministic step i recomputed with the trajectory's solver
    from the streamed x_i and the velocities; NaN at the stochastic steps.

    ``velocities`` [T, ...] is v_i after guidance at every step (the stream's VELOCITY debug tensors,
    or the trainer's own forwards): the solver's history holds the data predictions x_i - s_i v_i of
    the deterministic steps since the last stochastic one (``rollout_core.solvers``), so every such
    step's is needed, with every latent (the ALL selection). With float32 latents each row is the
    streamed x_{i+1} bitwise (the same elementwise float32 operations); bf16 and fp16 latents are
    streamed rounded, and the rows here are not.
    """
    sigmas, history = trajectory.sigmas, solvers.History()
    regenerated = torch.full_like(velocities, float("nan"), dtype=torch.float32)
    for i in range(trajectory.num_steps):
        x, v = trajectory.latents[i].unsqueeze(0), velocities[i].unsqueeze(0)
        if trajectory.stochastic[i]:
            history = solvers.History()  # the noise ends the history
            continue
        solved = solvers.solver_step(trajectory.solver, x, v, sigmas, i, history)
        regenerated[i], history = solved.x_next[0], solved.history
    return regenerated
