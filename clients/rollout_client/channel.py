"""How a client's channel is set up: its receive limit and gRPC's own retries of refused rollouts.

A Rollout call that a server refuses before its first message, because it is full
(RESOURCE_EXHAUSTED) or going away (UNAVAILABLE), is tried again by gRPC itself, with exponential
backoff: the channel's service config carries a ``retryPolicy`` for the Rollout method, with the
codes of ``rollout_client.failures.CHANNEL_RETRIES`` by default. gRPC never retries a call once a
response message has arrived, so a rollout that started is never run twice.
gRPC does not tell the application how many attempts a call took; servers return the count they
received in the ``rollout-previous-attempts`` trailer.

Imports grpc, the generated messages, ``failures`` and ``rollout_core.transport`` only, so that command lines
read these constants without loading torch.
"""

import json
from dataclasses import dataclass

import grpc

from rollout.v1 import rollout_pb2
from rollout_client.failures import CHANNEL_RETRIES
from rollout_core.transport import MAX_RECEIVE_BYTES, PREVIOUS_ATTEMPTS_TRAILER

# gRPC keeps a request it may have to send again until the call commits (a larger one is sent once,
# never retried): enough for any request a server with the default limits takes (its
# `limits.max_request_bytes`: 16 conditioning images of 4 MiB and 4 MiB for the rest), above gRPC's
# own 256 KiB.
RETRY_BUFFER_BYTES = 68 * 1024 * 1024
# gRPC ignores attempts above this many.
MAX_ATTEMPTS_LIMIT = 5
_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's retries of a Rollout call refused before its first message.

    Attempt n + 1 waits about ``min(initial_backoff * backoff_multiplier ** (n - 1), max_backoff)``
    seconds (gRPC adds 20% jitter); ``max_attempts`` counts the first one and is at most 5. The
    defaults wait about 0.25 + 0.5 + 1 + 2 = 3.75 s in all before the refusal reaches the caller.
    The call's deadline (the client's ``timeout``) bounds the whole, backoffs included.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.25
    max_backoff: float = 4.0
    backoff_multiplier: float = 2.0
    codes: tuple[grpc.StatusCode, ...] = CHANNEL_RETRIES

    def __post_init__(self):
        if not 2 <= self.max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise ValueError(f"max_attempts must be in [2, {MAX_ATTEMPTS_LIMIT}], got {self.max_attempts}")
        for name in ("initial_backoff", "max_backoff"):
            if not getattr(self, name) >= 0.001:
                raise ValueError(f"{name} must be at least 0.001 seconds, got {getattr(self, name)}")
        if not self.backoff_multiplier > 0:
            raise ValueError(f"backoff_multiplier must be positive, got {self.backoff_multiplier}")
        if not self.codes or grpc.StatusCode.OK in self.codes:
            raise ValueError(f"codes must name one or more error codes, got {self.codes}")

    def service_config(self) -> str:
        """The channel's service config JSON: this policy on the Rollout method."""
        policy = {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff:.3f}s",
            "maxBackoff": f"{self.max_backoff:.3f}s",
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": [code.name for code in self.codes],
        }
        rollout = {"service": _SERVICE, "method": "Rollout"}
        return json.dumps({"methodConfig": [{"name": [rollout], "retryPolicy": policy}]})


DEFAULT_RETRY = RetryPolicy()


def base_options(retry: RetryPolicy | None) -> list[tuple[str, int | str]]:
    """The options every client channel starts from: the receive limit, and ``retry`` (None: no retries)."""
    options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
    if retry is None:
        return [*options, ("grpc.enable_retries", 0)]
    return [
        *options,
        ("grpc.enable_retries", 1),
        ("grpc.service_config", retry.service_config()),
        ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES),
    ]


def previous_attempts(trailing_metadata) -> int:
    """The earlier attempts of a call, as its server reported them (0 when it reported none)."""
    value = dict(trailing_metadata or ()).get(PREVIOUS_ATTEMPTS_TRAILER, "")
    return int(value) if value.isascii() and value.isdigit() and int(value) < MAX_ATTEMPTS_LIMIT else 0
