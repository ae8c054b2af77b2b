"""Serving behaviour on real server processes (DESIGN §6): cancellation, deadlines, overload, shutdown.

A "long" rollout is 100 steps of two 64x64 samples (about 230 KiB of step messages). The test
channels turn off gRPC's BDP probing, which would otherwise grow the flow-control window to megabytes:
with the fixed 64 KiB window a client that stops reading holds the rollout in flight on the server,
so no test depends on how fast the CPU is. Every wait is bounded: a server bug fails a test instead
of hanging the suite.
"""

import re
import signal
import threading
import time
import uuid

import grpc
import pytest
from conftest import start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.v1 import rollout_pb2, rollout_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
WAIT_SECONDS = 30.0
# A fixed 64 KiB stream window: the server can only run a few steps ahead of its reader.
HOLDING_OPTIONS = [("grpc.http2.bdp_probe", 0)]


def long_request(request_id: str) -> rollout_pb2.RolloutRequest:
    return rollout_pb2.RolloutRequest(
        request_id=request_id,
        prompts=["a red fox"],
        samples_per_prompt=2,
        base_seed=3,
        height=64,
        width=64,
        num_steps=100,
        images=False,
    )


def small_request() -> rollout_pb2.RolloutRequest:
    return rollout_pb2.RolloutRequest(
        prompts=["a blue bird"], base_seed=5, height=64, width=64, num_steps=2, images=False
    )


def unique_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def run_small_rollout(stub) -> list[str]:
    """Run a tiny rollout to the end and return its event kinds."""
    return [message.WhichOneof("event") for message in stub.Rollout(small_request(), timeout=WAIT_SECONDS)]


def assert_serves(stub) -> None:
    assert run_small_rollout(stub) == ["started", "step", "step", "finished"]


def logged_status(server, request_id: str, timeout: float = WAIT_SECONDS) -> str | None:
    """Wait for the server's end-of-rollout log line of ``request_id`` and return its status."""
    pattern = re.compile(rf"rollout id={re.escape(request_id)} .*status=(\w+)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = pattern.search(server.log())
        if match:
            return match[1]
        time.sleep(0.1)
    return None


def health_status(channel: grpc.Channel) -> int | grpc.StatusCode:
    """The overall health status, or the error code when the check itself fails."""
    try:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as error:
        return error.code()
    return response.status


def drain(call) -> grpc.StatusCode:
    """Read a stream to its end in a helper thread (bounded) and return how it ended."""
    outcome = []

    def read() -> None:
        try:
            for _ in call:
                pass
            outcome.append(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            outcome.append(error.code())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=WAIT_SECONDS)
    if reader.is_alive():
        call.cancel()
        pytest.fail("the running stream did not end")
    return outcome[0]


def holding_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=HOLDING_OPTIONS)


@pytest.fixture(scope="module")
def stub(server):
    with holding_channel(server.address) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


@pytest.fixture
def launch(tiny_flux_folder, cache_dir, tmp_path):
    """Start dedicated servers with extra flags; any still running at teardown are killed."""
    launched = []

    def launch_server(*args: str):
        launched.append(start_server(cache_dir, tmp_path / f"server-{len(launched)}.log", *args))
        return launched[-1]

    yield launch_server
    for server in launched:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(timeout=WAIT_SECONDS)


def test_client_cancel_stops_the_rollout(server, stub):
    """Cancelling a call mid-stream ends the rollout on the server with status CANCELLED and frees
    the (single) worker: the next rollout runs."""
    request_id = unique_id("cancel")
    call = stub.Rollout(long_request(request_id), timeout=WAIT_SECONDS)
    assert next(call).WhichOneof("event") == "started"
    assert next(call).step.index == 0
    call.cancel()
    assert logged_status(server, request_id) == "CANCELLED"
    assert_serves(stub)


def test_expired_deadline(server, stub):
    """A 1 s deadline on a long rollout that the client reads too slowly gives DEADLINE_EXCEEDED;
    the server stops the rollout and keeps serving."""
    request_id = unique_id("deadline")
    with pytest.raises(grpc.RpcError) as raised:
        for _ in stub.Rollout(long_request(request_id), timeout=1.0):
            time.sleep(0.1)  # 100 steps take this reader 10 s, and the server cannot run ahead
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert logged_status(server, request_id) == "CANCELLED"
    assert_serves(stub)


def test_overload_is_resource_exhausted(launch):
    """With --max-queued 1, a second rollout while one is in flight gets RESOURCE_EXHAUSTED; once the
    first is cancelled, rollouts are admitted again."""
    server = launch("--max-queued", "1")
    with holding_channel(server.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        info = stub.GetServerInfo(rollout_pb2.GetServerInfoRequest(), timeout=WAIT_SECONDS)
        assert info.limits.max_queued_requests == 1
        first = stub.Rollout(long_request(unique_id("hold")), timeout=WAIT_SECONDS)
        assert next(first).WhichOneof("event") == "started"  # admitted; not read any further
        with pytest.raises(grpc.RpcError) as raised:
            run_small_rollout(stub)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit 1" in raised.value.details()

        first.cancel()
        # The place frees once the worker notices the cancel (at its next step or blocked send).
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            try:
                assert_serves(stub)
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the cancelled rollout was never released"
                time.sleep(0.1)
    assert "Traceback" not in server.log()


def test_graceful_shutdown_on_sigterm(launch):
    """SIGTERM while a rollout streams: health leaves SERVING, new rollouts get UNAVAILABLE, the
    running rollout gets the 2 s grace period and is then cancelled, its stream ends, and the process
    exits with code 0."""
    server = launch("--grace-seconds", "2")
    with holding_channel(server.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        assert health_status(channel) == SERVING
        request_id = unique_id("running")
        running = stub.Rollout(long_request(request_id), timeout=WAIT_SECONDS)
        assert next(running).WhichOneof("event") == "started"  # held in flight: not read further

        signalled_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        while (status := health_status(channel)) == SERVING:
            assert time.monotonic() < signalled_at + WAIT_SECONDS, "health still SERVING after SIGTERM"
            time.sleep(0.05)
        # A check that is in flight when the server stops accepting calls is cancelled by gRPC.
        going_away = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING or status in going_away

        with pytest.raises(grpc.RpcError) as raised:
            run_small_rollout(stub)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE

        assert server.process.wait(timeout=WAIT_SECONDS) == 0
        assert time.monotonic() - signalled_at >= 1.9  # the grace period was honoured
        assert drain(running) in going_away
    assert "shutting down (grace 2 s)" in server.log()
    assert logged_status(server, request_id) == "CANCELLED"


def test_sigint_stops_the_server(launch):
    """SIGINT (Ctrl-C) shuts the server down cleanly too: exit code 0."""
    server = launch()
    with grpc.insecure_channel(server.address) as channel:
        assert health_status(channel) == SERVING
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=WAIT_SECONDS) == 0
    assert "shutting down" in server.log()
