"""Recompute a trajectory's log-probs from the model, the way a trainer does in its policy update."""

from typing import TYPE_CHECKING

import torch

from rollout_client.grpo import Transformer, step_log_probs

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
