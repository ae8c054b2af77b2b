"""Prometheus metrics of one server, in a registry of its own, served by ``--metrics-port``.

Observing never touches a tensor's values: the engine reads the clock around each batched step,
the runner counts rows per forward, the stream counts message sizes.
"""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rollout.v1 import rollout_pb2

PREFIX = "rollout_server"


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.rollouts = Counter(
            f"{PREFIX}_rollouts", "Admitted rollouts by final status", ["status"], registry=r
        )
        self.rejected = Counter(
            f"{PREFIX}_rejected_requests", "Calls refused before any work, by reason", ["reason"], registry=r
        )
        self.steps = Counter(f"{PREFIX}_steps", "Denoising steps taken, one per rollout per step", registry=r)
        self.step_seconds = Histogram(
            f"{PREFIX}_step_seconds",
            "Time of one batched step: the forwards, the step math and the encoding of its messages",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.rollouts_per_step = Histogram(
            f"{PREFIX}_rollouts_per_step",
            "Rollouts stepping together in one batched step",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.rows_per_forward = Histogram(
            f"{PREFIX}_rows_per_forward",
            "Transformer rows (a sample in one CFG branch) in one forward",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.streamed_bytes = Counter(
            f"{PREFIX}_streamed_bytes", "Serialized bytes of the rollout messages streamed", registry=r
        )
        self.weight_update_seconds = Histogram(
            f"{PREFIX}_weight_update_seconds",
            "Weight updates, from the call's start until applied",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.weight_update_bytes = Counter(
            f"{PREFIX}_weight_update_bytes", "Tensor bytes of the applied weight updates", registry=r
        )
        self.in_flight = Gauge(
            f"{PREFIX}_in_flight_rollouts", "Admitted rollouts queued or running", registry=r
        )
        self.running = Gauge(
            f"{PREFIX}_running_rollouts", "Rollouts in the running set (stepping or parked)", registry=r
        )
        self.queue_depth = Gauge(
            f"{PREFIX}_queue_depth", "Rollouts and weight updates waiting to start", registry=r
        )
        self.policy_version = Gauge(f"{PREFIX}_policy_version", "Policy version being served", registry=r)
        self.prompt_cache_hits = Counter(
            f"{PREFIX}_prompt_cache_hits", "Texts whose conditioning came from the prompt cache", registry=r
        )
        self.prompts_encoded = Counter(
            f"{PREFIX}_prompts_encoded", "Texts run through the text encoders", registry=r
        )

    def watch(self, status: Callable) -> None:
        """Read the engine's admission, queue and policy version (``status()``, an EngineStatus) at
        each scrape."""
        self.in_flight.set_function(lambda: status().in_flight)
        self.running.set_function(lambda: status().running)
        self.queue_depth.set_function(lambda: status().queued)
        self.policy_version.set_function(lambda: status().policy_version)

    def reject(self, reason: str) -> None:
        """A call refused before any work: invalid_argument, overloaded, unauthenticated,
        permission_denied, shutting_down or memory_released."""
        self.rejected.labels(reason).inc()

    def forward(self, rows: int) -> None:
        """One transformer call on ``rows`` rows."""
        self.rows_per_forward.observe(rows)

    def batched_step(self, rollouts: int, seconds: float) -> None:
        """``rollouts`` took one step together in ``seconds``."""
        self.steps.inc(rollouts)
        self.rollouts_per_step.observe(rollouts)
        self.step_seconds.observe(seconds)

    def prompt_cache(self, hits: int, encoded: int) -> None:
        self.prompt_cache_hits.inc(hits)
        self.prompts_encoded.inc(encoded)

    def weight_update(self, nbytes: int, seconds: float) -> None:
        self.weight_update_seconds.observe(seconds)
        self.weight_update_bytes.inc(nbytes)

    def counting(self, emit: Callable[[rollout_pb2.RolloutResponse], None]) -> Callable:
        """``emit`` that also counts the bytes of each message."""

        def counted(message: rollout_pb2.RolloutResponse) -> None:
            self.streamed_bytes.inc(message.ByteSize())
            emit(message)

        return counted

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP on a daemon thread; returns the bound port (``port`` 0: a free one)."""
        server, _ = start_http_server(port, host, registry=self.registry)
        return server.server_address[1]
