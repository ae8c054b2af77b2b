#!/usr/bin/env bash
# Standard gRPC health check. Usage: health.sh [SERVICE]; no SERVICE checks the whole server, or
# give rollout.v1.RolloutService. Prints SERVING, or NOT_SERVING while the server shuts down.
set -euo pipefail
ADDRESS=${ADDRESS:-127.0.0.1:50051}

grpcurl -plaintext -d "{\"service\": \"${1:-}\"}" "$ADDRESS" grpc.health.v1.Health/Check
