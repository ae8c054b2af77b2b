"""Python client for rollout-server: typed streaming events, trajectories, log-prob replay, and the
trainer's helpers (``rollout_client.grpo``, ``rollout_client.rewards``).

Imports torch, safetensors and grpc, never diffusers: a trainer can use it with any model code.
"""

from rollout_client.channel import RetryPolicy
from rollout_client.client import RolloutClient
from rollout_client.credentials import TLS, read_token
from rollout_client.events import Finished, Image, Started, Step
from rollout_client.pool import RolloutPool
from rollout_client.replay import replay_log_probs
from rollout_client.trajectory import Collector, Trajectory, collect

__all__ = [
    "Collector",
    "Finished",
    "Image",
    "RetryPolicy",
    "RolloutClient",
    "RolloutPool",
    "Started",
    "Step",
    "TLS",
    "Trajectory",
    "collect",
    "read_token",
    "replay_log_probs",
]
