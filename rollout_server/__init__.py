"""rollout-server: a gRPC streaming rollout engine for flow-matching RL."""

import os

# transformers reports at import time that optional backends we never use are missing (torchvision
# for the image processors diffusers' pipelines import): keep the server's terminal to its own output.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__version__ = "0.1.0"
