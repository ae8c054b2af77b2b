#!/usr/bin/env bash
# A full rollout stream: tensors as base64 safetensors bytes, images as base64 PNG (see README.md).
# Usage: rollout.sh ['{"prompts": ["..."], ...}']; the default request is a small one.
set -euo pipefail
ADDRESS=${ADDRESS:-127.0.0.1:50051}
REQUEST=${1:-'{"prompts": ["a red fox"], "samples_per_prompt": 2, "base_seed": 7, "height": 64, "width": 64, "num_steps": 4}'}

grpcurl -plaintext -d "$REQUEST" "$ADDRESS" rollout.v1.RolloutService/Rollout
