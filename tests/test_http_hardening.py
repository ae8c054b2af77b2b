"""The HTTP front end against peers that hold what they can: idle connections, requests that never
arrive whole, answers nobody reads, a flood of /health_generate, and weight-endpoint errors named as
SGLang's body names its fields. One server with small limits and short deadlines, real sockets."""

import json
import re
import select
import socket
import threading
import time

import httpx
import pytest
from support.servers import http_url, metrics_url, scrape, start_server

from rollout_server.http_api import PROBE_REUSE_SECONDS, SPARE_REQUESTS

READ_SECONDS = 4  # --http-read-seconds
STALL_SECONDS = 3  # --stall-seconds
MAX_QUEUED, MAX_WAITING = 3, 1
# Requests the front end takes at once, the health probes aside.
MAX_REQUESTS = MAX_QUEUED + MAX_WAITING + SPARE_REQUESTS
# More idle connections than shut the API when uvicorn counted connections (about 330 of them under
# the default limits, MAX_REQUESTS here).
IDLE_CONNECTIONS = 340
SMALL = {"prompt": "a red fox", "width": 64, "height": 64, "num_inference_steps": 4, "rollout": False}
# Two 512 x 512 images and nothing else: the answer's bound is 2 x (3 x 512 x 512 x 4 + 64 KiB) =
# 6,422,528 bytes (sglang.response_bound), so one fits under MAX_RESPONSE_BYTES and two do not; its
# 6.3 MB are more than loopback's socket buffers hold for a client that does not read.
LARGE = {**SMALL, "width": 512, "height": 512, "num_inference_steps": 1, "num_outputs_per_prompt": 2}
MAX_RESPONSE_BYTES = 10_000_000


@pytest.fixture(scope="module")
def hardened(cache_dir, tiny_flux_folder, tmp_path_factory):
    """A tiny-flux server with the HTTP front end under small limits and short deadlines."""
    weights_root = tmp_path_factory.mktemp("weights-root")
    server = start_server(
        cache_dir,
        tmp_path_factory.mktemp("logs") / "http-hardening.log",
        *("--http-port", "0", "--metrics-port", "0", "--weights-root", str(weights_root)),
        *("--max-queued", str(MAX_QUEUED), "--max-waiting", str(MAX_WAITING)),
        *("--http-read-seconds", str(READ_SECONDS), "--stall-seconds", str(STALL_SECONDS)),
        *("--max-http-response-bytes", str(MAX_RESPONSE_BYTES)),
    )
    yield server
    assert server.stop() == 0


def address(url: str) -> tuple[str, int]:
    host, port = re.match(r"http://(.+):(\d+)", url).groups()
    return host, int(port)


def request_bytes(body: dict) -> bytes:
    content = json.dumps(body).encode()
    head = (
        "POST /rollout/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(content)}\r\n\r\n"
    )
    return head.encode() + content


def rollouts_ended(server) -> float:
    """Rollouts the server has admitted and ended, whatever their status."""
    samples = scrape(metrics_url(server))
    return sum(value for (name, _), value in samples.items() if name == "rollout_server_rollouts_total")


def wait_for_log(server, pattern: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, server.log()):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)


def test_idle_connections_leave_health_answered_and_are_closed_after_the_read_bound(hardened):
    """340 connections that never send a byte, and MAX_REQUESTS requests whose body never comes whole:
    /health is answered (200, within a second) throughout, a further request is refused (429: the
    half-sent ones hold the request places), and every one of them is closed once --http-read-seconds
    have passed since it opened, after which requests are served again."""
    url = http_url(hardened)
    host, port = address(url)
    opened_at = time.monotonic()
    held = [socket.create_connection((host, port)) for _ in range(IDLE_CONNECTIONS)]
    try:
        whole = request_bytes(SMALL)
        for _ in range(MAX_REQUESTS):
            held.append(socket.create_connection((host, port)))
            held[-1].sendall(whole[:-1])
        with httpx.Client(base_url=url, timeout=60) as client:
            # Answered after the half-sent requests were read: their places are taken by now.
            assert client.get("/health").status_code == 200
            refused = client.post("/rollout/generate", json=SMALL)
            assert refused.status_code == 429 and "HTTP requests are in progress" in refused.text, (
                refused.text
            )
            open_sockets, closed_at = list(held), []
            while open_sockets:
                assert time.monotonic() < opened_at + READ_SECONDS + 60, f"{len(open_sockets)} still open"
                probed_at = time.perf_counter()
                assert client.get("/health").status_code == 200
                assert time.perf_counter() - probed_at < 1.0  # the bound: health within a second
                readable, _, _ = select.select(open_sockets, [], [], 0.1)
                for connection in readable:
                    assert connection.recv(1) == b""  # closed by the server, without an answer
                    open_sockets.remove(connection)
                    closed_at.append(time.monotonic())
            # The server's deadline runs from its accept, after opened_at.
            assert min(closed_at) - opened_at >= READ_SECONDS
            assert client.post("/rollout/generate", json=SMALL).status_code == 200
    finally:
        for connection in held:
            connection.close()


def test_a_flood_of_health_generate_shares_one_probe_and_refuses_no_rollout(hardened):
    """Eight clients ask /health_generate again and again while two trainers run four rollouts each:
    every probe is answered 200, no trainer's rollout is refused (at most one probe rollout holds a
    queue place at a time, and the queue takes three), and the flood costs one probe rollout per
    PROBE_REUSE_SECONDS."""
    url = http_url(hardened)
    before = rollouts_ended(hardened)
    flooding, probe_answers, trainer_answers = threading.Event(), [], []

    def flood():
        with httpx.Client(base_url=url, timeout=120) as client:
            while flooding.is_set():
                probe_answers.append(client.get("/health_generate").status_code)

    def train():
        with httpx.Client(base_url=url, timeout=120) as client:
            for _ in range(4):
                trainer_answers.append(client.post("/rollout/generate", json=SMALL).status_code)

    flooding.set()
    started_at = time.monotonic()
    floods = [threading.Thread(target=flood) for _ in range(8)]
    trainers = [threading.Thread(target=train) for _ in range(2)]
    for thread in floods + trainers:
        thread.start()
    for thread in trainers:
        thread.join()
    flooding.clear()
    for thread in floods:
        thread.join()
    elapsed = time.monotonic() - started_at
    assert trainer_answers == [200] * 8
    assert probe_answers and set(probe_answers) == {200}
    probes = rollouts_ended(hardened) - before - len(trainer_answers)
    assert probes <= 1 + elapsed // PROBE_REUSE_SECONDS, (probes, elapsed, len(probe_answers))


def test_an_unread_answer_holds_its_bytes_until_it_is_dropped_after_the_stall_limit(hardened):
    """A client that never reads keeps its answer's bytes reserved (a second answer that would pass
    --max-http-response-bytes is refused, 429) until --stall-seconds after its connection stopped
    taking them; then the connection is dropped, and the same request is served in full."""
    url = http_url(hardened)
    host, port = address(url)
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    reader.connect((host, port))
    try:
        reader.sendall(request_bytes(LARGE))
        assert select.select([reader], [], [], 120)[0]  # its answer is being sent
        with httpx.Client(base_url=url, timeout=120) as client:
            refused = client.post("/rollout/generate", json=LARGE)
            assert refused.status_code == 429, (refused.status_code, refused.text[:300])
            assert "--max-http-response-bytes" in refused.text
            wait_for_log(hardened, r"HTTP connection of \S+ dropped: it took too little of its answer")
            served = client.post("/rollout/generate", json=LARGE)
            assert served.status_code == 200
            assert int(served.headers["content-length"]) == len(served.content) > 2 * 3 * 512 * 512 * 4
    finally:
        reader.close()


WEIGHT_BODIES = [
    # LoadWeights's own checks name its path and target; the answer names SGLang's fields.
    ('{"model_path": "a\\u0000b"}', "model_path"),
    ('{"model_path": "w", "target_modules": ["nope"]}', "target_modules"),
    ('{"model_path": "\\ud800"}', "model_path"),  # a lone surrogate (once a 500)
    ('{"model_path": "w", "target_modules": ["\\udfff"]}', "target_modules"),
    ('{"model_path": "w", "policy_version": -1}', "policy_version"),
]


@pytest.mark.parametrize(("body", "field"), WEIGHT_BODIES, ids=[str(i) for i in range(len(WEIGHT_BODIES))])
def test_weight_endpoint_errors_name_sglangs_fields_in_one_log_line(hardened, body, field):
    url = http_url(hardened)
    logged = hardened.log()
    answer = httpx.post(
        f"{url}/update_weights_from_disk", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400, answer.text
    assert [violation["field"] for violation in answer.json()["violations"]] == [field]
    assert answer.json()["success"] is False and answer.json()["message"].startswith(
        f"invalid request: {field}:"
    )
    new_lines = hardened.log()[len(logged) :].splitlines()
    assert len(new_lines) == 1 and "rejected" in new_lines[0], new_lines


def test_a_checksum_request_with_a_lone_surrogate_is_a_400(hardened):
    answer = httpx.post(
        f"{http_url(hardened)}/get_weights_checksum",
        content='{"module_names": ["\\ud800"]}',
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["violations"][0]["field"] == "module_names"
