"""rollout-server: a gRPC streaming rollout engine for flow-matching RL."""

__version__ = "0.1.0"
