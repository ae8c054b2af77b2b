"""Server limits: every request dimension is bounded, and GetServerInfo reports the bounds."""

from dataclasses import dataclass

from rollout.v1 import rollout_pb2

# Just below 4 MiB, so grpcurl and default gRPC clients (4 MiB receive limit) work unchanged.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024 - 64 * 1024
# Policy versions (an update's, a request's minimum) stay below 2^63: a version at the top of the
# uint64 range would leave no room for the next update.
MAX_POLICY_VERSION = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    max_samples: int = 64
    max_batch_size: int = 8
    max_steps: int = 100
    max_side: int = 2048
    max_prompt_chars: int = 4096
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_queued_requests: int = 16
    max_noise_level: float = 1.0
    max_request_id_chars: int = 128

    def to_proto(self, side_multiple: int) -> rollout_pb2.Limits:
        return rollout_pb2.Limits(
            max_samples=self.max_samples,
            max_batch_size=self.max_batch_size,
            max_steps=self.max_steps,
            max_side=self.max_side,
            side_multiple=side_multiple,
            max_prompt_chars=self.max_prompt_chars,
            max_message_bytes=self.max_message_bytes,
            max_queued_requests=self.max_queued_requests,
            max_noise_level=self.max_noise_level,
        )
