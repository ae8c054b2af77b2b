#!/usr/bin/env bash
# A small rollout with tensor manifests only (no tensor bytes, no images): readable in a terminal.
# -emit-defaults shows zero values too (step 0, stochastic: false, following_chunks: 0, ...).
set -euo pipefail
ADDRESS=${ADDRESS:-127.0.0.1:50051}

grpcurl -plaintext -emit-defaults -d @ "$ADDRESS" rollout.v1.RolloutService/Rollout <<'JSON'
{
  "prompts": ["a red fox"],
  "samples_per_prompt": 2,
  "base_seed": 7,
  "height": 64,
  "width": 64,
  "num_steps": 4,
  "manifest_only": true,
  "images": false
}
JSON
