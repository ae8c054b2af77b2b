"""rollout-server: a gRPC streaming rollout engine for flow-matching RL."""

import os

# Keep the server's terminal to its own output: transformers reports at import time that optional
# backends we never use are missing (torchvision, for the image processors diffusers' pipelines
# import), and it and huggingface_hub draw progress bars while a model loads (read at import time).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

__version__ = "0.1.0"
