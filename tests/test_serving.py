"""Serving behaviour on real server processes: cancellation, deadlines, overload, shutdown.

A "long" rollout is 100 steps of two 64x64 samples (about 230 KiB of step messages). The test
channels turn off gRPC's BDP probing, which would otherwise grow the flow-control window to megabytes:
with the fixed 64 KiB window a client that stops reading holds the rollout in flight on the server,
so no test depends on how fast the CPU is. Every wait is bounded: a server bug fails a test instead
of hanging the suite.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from support.errors import health_status
from support.requests import HOLDING_OPTIONS
from support.servers import SERVER_THREADS, http_url, imported_modules, metrics_url, scrape, start_server

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client import RetryPolicy, RolloutClient
from rollout_client.client import RolloutStats
from rollout_core.local_server import LocalServer
from rollout_server.presets import preset_names, resolve_model

SERVING = health_pb2.HealthCheckResponse.SERVING
WAIT_SECONDS = 30.0


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


@pytest.fixture(scope="module")
def one_slot(tiny_flux_folder, cache_dir, tmp_path_factory):
    """A server with one rollout place and two places to wait for a policy version; the tests that
    share it leave nothing running on it."""
    log = tmp_path_factory.mktemp("one-slot") / "server.log"
    server = start_server(
        cache_dir,
        log,
        *("--max-queued", "1", "--max-waiting", "2"),
        # The HTTP front end, its answers in flight bounded to about one of 8 samples at 64 x 64.
        *("--http-port", "0", "--max-http-response-bytes", "1.5MB"),
    )
    yield server
    server.stop()


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
    assert "never retrieved" not in server.log()  # the write pending at the deadline was taken care of


def test_overload_is_resource_exhausted(one_slot):
    """With --max-queued 1, a second rollout while one is in flight gets RESOURCE_EXHAUSTED; once the
    first is cancelled, rollouts are admitted again."""
    server = one_slot
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
        # The HTTP front end shares the queue: 429, and when to come back.
        body = {"prompt": "a", "width": 64, "height": 64, "num_inference_steps": 2}
        refused = httpx.post(f"{http_url(server)}/rollout/generate", json=body, timeout=WAIT_SECONDS)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "limit 1" in refused.json()["detail"]

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


def test_http_answers_in_flight_are_bounded_together(one_slot):
    """While one HTTP answer of 8 samples is in flight, a second that would pass
    --max-http-response-bytes with it gets 429 before it queues; once the first client leaves, its
    share is free again and a rollout runs."""
    url = http_url(one_slot)
    host, port = re.match(r"http://(.+):(\d+)", url).groups()
    body = {"prompt": "a red fox", "width": 64, "height": 64, "num_outputs_per_prompt": 8}
    held = json.dumps({**body, "num_inference_steps": 100}).encode()
    with socket.create_connection((host, int(port))) as connection:
        head = f"POST /rollout/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(held)}\r\n\r\n"
        connection.sendall(head.encode() + held)
        deadline = time.monotonic() + WAIT_SECONDS
        while True:  # until the held rollout is admitted, the second one is refused
            second = httpx.post(
                f"{url}/rollout/generate", json={**body, "num_inference_steps": 1}, timeout=60
            )
            if second.status_code == 429:
                break
            assert second.status_code == 200 and time.monotonic() < deadline
        assert "answers in flight" in second.json()["detail"] and second.headers["retry-after"] == "1"
    deadline = time.monotonic() + WAIT_SECONDS
    while (
        answer := httpx.post(f"{url}/rollout/generate", json={**body, "num_inference_steps": 1}, timeout=60)
    ).status_code == 429:
        assert time.monotonic() < deadline, "the held answer's share was never released"
        time.sleep(0.1)
    assert answer.status_code == 200


def test_a_cancelled_call_frees_its_place_at_once(launch):
    """With --max-queued 2 and one rollout in long rounds (1-2 s a step), calls that start and
    are cancelled one after another are each admitted: a cancel frees its place at once, not when
    the round ends."""
    server = launch("--max-queued", "2")
    with grpc.insecure_channel(server.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        long_round = rollout_pb2.RolloutRequest(
            prompts=["a red fox"],
            samples_per_prompt=8,
            height=1024,
            width=1024,
            num_steps=20,
            images=False,
            latents=rollout_pb2.LATENT_SELECTION_NONE,
        )
        running = stub.Rollout(long_round, timeout=WAIT_SECONDS)
        assert next(running).WhichOneof("event") == "started"
        refused = []
        for cycle in range(5):
            request = small_request()
            request.request_id = unique_id(f"cycle{cycle}")
            call = stub.Rollout(request, timeout=WAIT_SECONDS)
            ended = threading.Event()
            call.add_done_callback(lambda _, ended=ended: ended.set())
            # A refusal comes at once; an admitted call waits for the round to end before it starts.
            if ended.wait(0.5) and call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refused.append(cycle)
            else:
                call.cancel()
                assert logged_status(server, request.request_id) == "CANCELLED"
        running.cancel()
        assert refused == [], f"cycles refused although every earlier call was cancelled: {refused}"
        assert_serves(stub)


def test_a_burst_of_single_prompt_rollouts_runs_at_the_default_limits(client):
    """A trainer's iteration sends tens of single-prompt requests at once: 64 concurrent rollouts on
    a server at the default limits all run, and none is refused even once."""
    retries = client.stats.retries

    def rollout(k: int) -> int:
        request = rollout_pb2.RolloutRequest(
            prompts=[f"prompt {k % 4}"], base_seed=k, height=64, width=64, num_steps=2, images=False
        )
        return len(client.rollout(request))

    with ThreadPoolExecutor(64) as executor:
        assert list(executor.map(rollout, range(64))) == [1] * 64
    assert client.stats.retries == retries


def test_refusals_before_the_first_message_are_retried(launch):
    """RolloutClient retries a rollout that a full server refused (RESOURCE_EXHAUSTED) until the
    place frees, and counts the retries; a draining server (UNAVAILABLE) is tried the default 5
    times; without a retry policy the refusal comes at once."""
    server = launch("--max-queued", "1", "--metrics-port", "0", "--grace-seconds", "60", "--http-port", "0")
    url = metrics_url(server)
    overloaded = ("rollout_server_rejected_requests_total", (("reason", "overloaded"),))
    with holding_channel(server.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        held = stub.Rollout(long_request(unique_id("hold")), timeout=WAIT_SECONDS)
        assert next(held).WhichOneof("event") == "started"  # the one place, held

        with RolloutClient(server.address, timeout=WAIT_SECONDS, retry=None) as impatient:
            with pytest.raises(grpc.RpcError) as raised:
                impatient.rollout(small_request())
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert impatient.stats == RolloutStats(calls=1, retries=0)

        # Backoffs of about 1, 2, 4 and 8 s: the place frees within them however slow this machine.
        patient_retry = RetryPolicy(initial_backoff=1.0, max_backoff=8.0)
        with (
            RolloutClient(server.address, timeout=WAIT_SECONDS, retry=patient_retry) as patient,
            ThreadPoolExecutor(1) as executor,
        ):
            refused = scrape(url)[overloaded]
            trajectories = executor.submit(patient.rollout, small_request())
            deadline = time.monotonic() + WAIT_SECONDS
            while scrape(url)[overloaded] == refused:  # until its first attempt was refused
                assert time.monotonic() < deadline, "the second rollout was never refused"
                time.sleep(0.05)
            held.cancel()
            assert len(trajectories.result(timeout=WAIT_SECONDS)) == 1
            assert patient.stats.calls == 1 and patient.stats.retries >= 1

        held = stub.Rollout(long_request(unique_id("hold")), timeout=WAIT_SECONDS)
        assert next(held).WhichOneof("event") == "started"  # keeps the server draining
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT_SECONDS
        while health_status(channel) == SERVING:
            assert time.monotonic() < deadline, "health still SERVING after SIGTERM"
            time.sleep(0.05)
        with RolloutClient(server.address, timeout=WAIT_SECONDS) as client:
            with pytest.raises(grpc.RpcError) as raised:
                client.rollout(small_request())
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in raised.value.details()
            assert client.stats == RolloutStats(calls=1, retries=RetryPolicy().max_attempts - 1)
        # The HTTP front end drains alike: 503, and when to come back.
        http = http_url(server)
        assert httpx.get(f"{http}/health", timeout=WAIT_SECONDS).status_code == 503
        body = {"prompt": "a", "width": 64, "height": 64, "num_inference_steps": 2}
        refused = httpx.post(f"{http}/rollout/generate", json=body, timeout=WAIT_SECONDS)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert "shutting down" in refused.json()["detail"]
        held.cancel()
        assert server.process.wait(timeout=WAIT_SECONDS) == 0


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
        # During the grace period the server still answers: connected clients see it going away.
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as raised:
            run_small_rollout(stub)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in raised.value.details()
        going_away = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

        assert server.process.wait(timeout=WAIT_SECONDS) == 0
        assert time.monotonic() - signalled_at >= 1.9  # the grace period was honoured
        assert drain(running) in going_away
    assert "shutting down (grace 2 s)" in server.log()
    assert logged_status(server, request_id) == "CANCELLED"


def test_rollouts_left_after_the_grace_period_end_as_shutting_down(launch, stub):
    """A rollout still computing when the grace period ends (its client reads on) ends with
    UNAVAILABLE "the server is shutting down", the documented status, not gRPC's own cancel."""
    # The grace period is a quarter of the same rollout's time on the shared server (the same preset
    # and threads): on a CPU of any speed the rollout is still computing when it ends. A fixed grace
    # let a fast CPU finish all 100 steps within it.
    started = time.perf_counter()
    assert list(stub.Rollout(long_request(unique_id("baseline")), timeout=WAIT_SECONDS))
    grace_seconds = (time.perf_counter() - started) / 4
    server = launch("--grace-seconds", f"{grace_seconds:.3f}")
    with grpc.insecure_channel(server.address) as channel:
        running = rollout_pb2_grpc.RolloutServiceStub(channel).Rollout(
            long_request(unique_id("slow")), timeout=WAIT_SECONDS
        )
        assert next(running).WhichOneof("event") == "started"
        server.process.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as raised:
            for _ in running:
                pass
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the server is shutting down" in raised.value.details()
    assert server.process.wait(timeout=WAIT_SECONDS) == 0


def test_stalled_reader_is_ended_and_frees_the_worker(launch):
    """A client with no deadline that stops reading holds its rollout only for --stall-seconds: then
    its stream ends with ABORTED and the worker moves on, so a rollout queued behind it (30 s
    deadline) completes."""
    server = launch("--stall-seconds", "2")
    with holding_channel(server.address) as held, grpc.insecure_channel(server.address) as other:
        stalled_id = unique_id("stalled")
        stalled = rollout_pb2_grpc.RolloutServiceStub(held).Rollout(long_request(stalled_id))
        assert next(stalled).WhichOneof("event") == "started"  # then never read again meanwhile

        victim = rollout_pb2_grpc.RolloutServiceStub(other)
        assert run_small_rollout(victim)[-1] == "finished"
        assert logged_status(server, stalled_id) == "ABORTED"
        with pytest.raises(grpc.RpcError) as raised:
            for _ in stalled:
                pass
        assert raised.value.code() == grpc.StatusCode.ABORTED
        assert "--stall-seconds" in raised.value.details()
        assert_serves(victim)
        assert health_status(other) == SERVING
    assert "Traceback" not in server.log()


def test_requests_waiting_for_a_policy_version_hold_no_rollout_slot(one_slot):
    """Requests waiting for a future policy version wait in a list of their own: with one rollout
    slot and two waiters, rollouts still run; a third waiter is refused at once; a version beyond
    2^63 - 1 is refused as invalid."""
    server = one_slot
    with grpc.insecure_channel(server.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        info = stub.GetServerInfo(rollout_pb2.GetServerInfoRequest(), timeout=WAIT_SECONDS)
        assert info.limits.max_waiting_requests == 2
        future = info.policy_version + 5

        def waiting(request_id: str) -> rollout_pb2.RolloutRequest:
            return rollout_pb2.RolloutRequest(
                prompts=["a blue bird"],
                height=64,
                width=64,
                num_steps=2,
                min_policy_version=future,
                request_id=request_id,
            )

        ids = [unique_id("waiter") for _ in range(2)]
        waiters = [stub.Rollout(waiting(request_id), timeout=WAIT_SECONDS) for request_id in ids]
        deadline = time.monotonic() + WAIT_SECONDS
        # Both in the wait list before the third comes: sent together, the third could take a place first.
        while not all(
            f"rollout id={request_id} waits for policy version" in server.log() for request_id in ids
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as raised:
            next(stub.Rollout(waiting(unique_id("third")), timeout=WAIT_SECONDS))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value.details()
        assert "wait for a policy version (limit 2)" in raised.value.details()

        assert_serves(stub)  # the one rollout slot is free
        for waiter in waiters:
            waiter.cancel()

        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Rollout(rollout_pb2.RolloutRequest(prompts=["x"], min_policy_version=2**64 - 1)))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "min_policy_version" in raised.value.details()
        assert_serves(stub)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--max-message-bytes", "100000"), "--max-message-bytes must be in"),
        (("--max-message-bytes", str(2**30)), "--max-message-bytes must be in"),
        (("--stall-seconds", "0"), "--stall-seconds must be positive"),
        (("--prune-hold-seconds", "nan"), "--prune-hold-seconds must be positive"),
    ],
)
def test_unworkable_limits_are_startup_errors(flags, message):
    """A limit that leaves a server unable to stream is refused at start-up, in one line."""
    result = subprocess.run(
        [sys.executable, "-m", "rollout_server", "serve", *flags], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_is_quiet_and_lists_every_preset():
    """``serve --help`` shows our own text only, with the presets from the preset table."""
    result = subprocess.run(
        [sys.executable, "-m", "rollout_server", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    assert result.stderr == ""
    assert result.stdout.startswith("usage: rollout-server serve")
    squeezed = "".join(result.stdout.split())  # argparse wraps lines, even inside a preset name
    assert f"presetname({','.join(preset_names())})" in squeezed
    assert set(preset_names()) == {
        "shapes",
        "tiny-flux",
        "small-flux",
        "tiny-sd3",
        "tiny-qwen-image",
        "tiny-wan",
        "tiny-wan2.2",
        "tiny-flux-kontext",
        "tiny-flux2",
        "tiny-flux2-klein",
        "tiny-qwen-image-edit",
        "tiny-wan-i2v",
        "tiny-z-image",
        "tiny-hunyuan-video15",
        "tiny-cosmos3",
        "tiny-ltx2",
    }


@pytest.mark.parametrize(
    "args, status",
    [(["--help"], 0), (["--port", "notanumber"], 2), (["--max-queued", "0"], 1)],
    ids=["help", "argparse-error", "limit-error"],
)
def test_the_command_line_answers_without_loading_the_model_libraries(args, status):
    """``serve --help`` and argument errors come back before torch and diffusers load (they take
    seconds); serving imports them."""
    returned, imported = imported_modules("rollout-server", "serve", *args)
    assert returned == status
    assert {"rollout_server.cli", "rollout_server.limits"} <= imported
    assert not imported & {"torch", "diffusers", "transformers"}


def test_the_dtype_choices_are_the_model_dtypes():
    from rollout_core.dtypes import MODEL_DTYPE_NAMES
    from rollout_server.cli import MODEL_DTYPES

    assert MODEL_DTYPES == MODEL_DTYPE_NAMES


def test_startup_shows_only_our_own_output(server):
    """From launch to "serving", the server's terminal holds its own log lines only: no library
    progress bar or import-time notice."""
    own_line = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) rollout_server[.\w]*: ")
    startup = server.log().split(" at " + server.address)[0].splitlines()
    assert startup and all(own_line.match(line) for line in startup), startup


def test_sigint_stops_the_server(launch):
    """SIGINT (Ctrl-C) shuts the server down cleanly too: exit code 0."""
    server = launch()
    with grpc.insecure_channel(server.address) as channel:
        assert health_status(channel) == SERVING
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=WAIT_SECONDS) == 0
    assert "shutting down" in server.log()


def test_model_path_is_absolute_with_a_relative_cache_dir(tiny_flux_folder, cache_dir, tmp_path):
    """GetServerInfo.model_path is absolute whatever the server's working directory and --cache-dir,
    so a trainer started elsewhere loads the same folder."""
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    relative = os.path.relpath(cache_dir, workdir)
    server = LocalServer.start(
        tmp_path / "server.log", "--cache-dir", relative, "--threads", SERVER_THREADS, cwd=workdir
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            info = stub.GetServerInfo(rollout_pb2.GetServerInfoRequest(), timeout=WAIT_SECONDS)
    finally:
        assert server.stop() == 0
    assert Path(info.model_path).is_absolute()
    assert Path(info.model_path) == resolve_model("tiny-flux", cache_dir) == tiny_flux_folder
