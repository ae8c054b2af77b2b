"""Python client for rollout-server: typed streaming events, trajectories, log-prob replay, and the
trainer's helpers (``rollout_client.grpo``, ``rollout_client.rewards``).

Imports torch, safetensors and grpc, never diffusers: a trainer can use it with any model code. The
names below load on first use, so that the command line does not load torch.
"""

import importlib

# Each exported name and the module that defines it.
_EXPORTS = {
    "Audio": "events",
    "Collector": "trajectory",
    "Finished": "events",
    "Image": "events",
    "Preview": "events",
    "RetryPolicy": "channel",
    "RolloutClient": "client",
    "RolloutPool": "pool",
    "RolloutSource": "source",
    "Started": "events",
    "Step": "events",
    "TLS": "credentials",
    "WeightSyncGroup": "weight_sync",
    "Trajectory": "trajectory",
    "collect": "trajectory",
    "read_token": "credentials",
    "regenerate_deterministic_steps": "replay",
    "replay_log_probs": "replay",
    "replay_stream_log_probs": "replay",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
