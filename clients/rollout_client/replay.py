"""Recompute a trajectory's log-probs from the model, the way a trainer does in its policy update."""

import torch

from rollout_client.trajectory import Trajectory
from rollout_core import dtypes, steps
from rollout_core.transformer_call import apply_guidance, call_transformer


def _on(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def replay_log_probs(
    transformer: torch.nn.Module, trajectory: Trajectory, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """float32 [T]: the log-prob of each stochastic step recomputed with ``transformer``; NaN elsewhere.

    For step i: v = guidance(transformer(x_i, t_i, **env)), mean = transition mean, and the streamed
    x_{i+1} is scored under N(mean, sd^2). Needs x_i and x_{i+1} of every stochastic step (the ALL or
    AROUND_STOCHASTIC latent selections).
    """
    device = torch.device(device)
    call = trajectory.transformer_call
    model_dtype = dtypes.BY_NAME[call["model_dtype"]]
    envs = {branch: {k: _on(v, device) for k, v in env.items()} for branch, env in trajectory.env.items()}
    replayed = torch.full((trajectory.num_steps,), float("nan"))
    for i in torch.nonzero(trajectory.stochastic).flatten().tolist():
        if not (trajectory.latent_mask[i] and trajectory.latent_mask[i + 1]):
            raise ValueError(f"step {i} is stochastic but x_{i} or x_{i + 1} was not streamed")
        x = trajectory.latents[i].unsqueeze(0).to(device)
        velocities = {
            branch: call_transformer(
                transformer, x, trajectory.timesteps[i].item(), env, model_dtype, call["timestep_divisor"]
            )
            for branch, env in envs.items()
        }
        v = apply_guidance(call["guidance_rule"], call["guidance_rule_scale"], velocities)
        kind = trajectory.sampler_type
        mean = steps.transition_mean(kind, x, v, trajectory.sigmas, i, trajectory.noise_level)
        sd = steps.noise_std(kind, trajectory.sigmas, i, trajectory.noise_level)
        x_next = trajectory.latents[i + 1].unsqueeze(0).to(device)
        replayed[i] = steps.log_prob(x_next - mean, sd, trajectory.log_prob_constants).item()
    return replayed
