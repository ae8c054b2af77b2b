#!/usr/bin/env bash
# GetServerInfo: model, family, defaults, limits, versions, LoRA targets and what a sample decodes to.
set -euo pipefail
ADDRESS=${ADDRESS:-127.0.0.1:50051}

grpcurl -plaintext "$ADDRESS" rollout.v1.RolloutService/GetServerInfo
