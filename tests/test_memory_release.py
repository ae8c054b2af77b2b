"""Sleep and wake for a trainer colocated on the server's devices: ReleaseMemory and ResumeMemory over
gRPC, SGLang's /release_memory_occupation and /resume_memory_occupation over HTTP. On a CPU the
weights' bytes leave the process (its resident memory drops by about their size) and come back;
rollouts are refused with a retry hint meanwhile, weight updates too; the weights that come back are
the same bytes (checksum) and the same policy version, and a rollout after is bitwise the one before.
A release waits for the rollout running when it comes; under --sp 2 every rank releases and resumes.
The colocated trainer (--colocate) is in test_train.py."""

import base64
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from safetensors import safe_open
from safetensors.torch import save
from support.requests import make_request
from support.servers import http_url, start_server, vm_rss_bytes

from rollout.v1 import rollout_pb2
from rollout_client import Finished, RolloutClient, Step
from rollout_core.dtypes import BY_SAFETENSORS
from rollout_server.presets import resolve_model

SMALL = {"prompts": ["a red fox"], "samples_per_prompt": 2, "base_seed": 5, "num_steps": 2}
REQUEST = make_request(SMALL, height=64, width=64)
# A tree rollout held at its prune point after step 1 (until its caller's prune: the module's server
# holds it for an hour), so it is running when the release comes, whatever the machine's speed.
HELD = make_request(
    SMALL,
    request_id="held",
    samples_per_prompt=1,
    num_steps=3,
    height=64,
    width=64,
    branches=[rollout_pb2.Branch(step=0, factor=2)],
    prune_points=[1],
)
# A safety net against a server that hangs, not a timing assertion.
WAIT_SECONDS = 120
RELEASED_LINE = re.compile(r"released \d+ tensors \((\d+) bytes\)")
RESTORED_LINE = re.compile(r"restored \d+ tensors \((\d+) bytes\)")


@pytest.fixture(scope="module")
def small_flux(cache_dir, tmp_path_factory):
    """A small-flux server of this module's own (its 110 MiB of weights stand well above the
    resident set's noise), with the HTTP front end; it holds a rollout at its prune point until its
    caller's prune."""
    log = tmp_path_factory.mktemp("memory") / "server.log"
    server = start_server(
        cache_dir, log, "--model", "small-flux", "--http-port", "0", "--prune-hold-seconds", "3600"
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(small_flux):
    """A client that sees refusals at once (no channel retries)."""
    with RolloutClient(small_flux.address, timeout=WAIT_SECONDS, retry=None) as client:
        yield client


def file_tensor_bytes(folder) -> int:
    """The bytes of every tensor the preset's safetensors files hold (read from their headers)."""
    total = 0
    for path in folder.glob("*/*.safetensors"):
        with safe_open(path, "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                piece = weights.get_slice(name)
                itemsize = BY_SAFETENSORS[piece.get_dtype()].itemsize
                total += torch.Size(piece.get_shape()).numel() * itemsize
    return total


def same_rollout(before, after) -> bool:
    return all(
        torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
        for a, b in zip(before, after, strict=True)
    )


def assert_rollout_refused(client: RolloutClient, url: str) -> None:
    """UNAVAILABLE with a retry hint over gRPC (gRPC's pushback trailer and google.rpc.RetryInfo),
    503 with Retry-After over HTTP."""
    with pytest.raises(grpc.RpcError) as refused:
        client.rollout(REQUEST)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "released" in refused.value.details()
    assert ("grpc-retry-pushback-ms", "5000") in refused.value.trailing_metadata()
    (detail,) = rpc_status.from_call(refused.value).details
    retry = error_details_pb2.RetryInfo()
    assert detail.Unpack(retry) and retry.retry_delay.seconds == 5
    body = {"prompt": "a red fox", "seed": 5, "width": 64, "height": 64, "num_inference_steps": 2}
    answer = httpx.post(f"{url}/rollout/generate", json=body, timeout=WAIT_SECONDS)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert "released" in answer.json()["detail"]


def test_released_weights_leave_the_process_and_come_back_the_same(small_flux, client, cache_dir):
    url = http_url(small_flux)
    folder = resolve_model("small-flux", cache_dir)
    before = client.rollout(REQUEST)
    info = client.server_info()
    resident = vm_rss_bytes(small_flux.process.pid)

    # As miles_diffusion releases: an empty JSON body; SGLang's answer, with ours beside it.
    answer = httpx.post(f"{url}/release_memory_occupation", json={}, timeout=WAIT_SECONDS)
    assert answer.status_code == 200, answer.text
    released = answer.json()
    assert (released["success"], released["sleeping"], released["changed"]) == (True, True, True)
    assert (released["policy_version"], released["weights_checksum"]) == (
        info.policy_version,
        info.weights_checksum,
    )
    moved = released["bytes"]
    assert moved >= file_tensor_bytes(folder)  # every weight of the pipeline (and its buffers)
    # Each released tensor was an allocation of its own, now handed back to the system. Nothing else
    # of the process grows by more than a few MiB between the two readings (no rollout runs): the
    # 10% margin is 11 MiB here.
    assert resident - vm_rss_bytes(small_flux.process.pid) >= 0.9 * moved

    again = client.release_memory()
    assert (again.released, again.changed, again.bytes) == (True, False, 0)
    assert client.server_info().memory_released
    assert_rollout_refused(client, url)
    with safe_open(folder / "transformer" / "diffusion_pytorch_model.safetensors", "pt") as weights:
        name = next(name for name in weights.keys() if name.endswith(".bias"))  # noqa: SIM118
        tensor = weights.get_tensor(name)
    with pytest.raises(grpc.RpcError) as refused:
        client.update_weights({name: tensor + 1}, info.policy_version + 1, "subset", progress=False)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "resume it" in refused.value.details()
    # Over HTTP too: a tensor push, and a check of tensors that are not there to read.
    pushed = httpx.post(
        f"{url}/update_weights_from_tensor",
        json={"serialized_named_tensors": [base64.b64encode(save({name: tensor + 1})).decode()]},
        timeout=WAIT_SECONDS,
    )
    assert pushed.status_code == 400 and "resume it" in pushed.json()["detail"], pushed.text
    checked = httpx.post(
        f"{url}/update_weights_from_tensor_checker",
        json={"target_module": "transformer", "expected_named_tensors_sha256": {name: "0" * 64}},
        timeout=WAIT_SECONDS,
    )
    assert checked.status_code == 400 and "resume it" in checked.json()["detail"], checked.text

    emptied = vm_rss_bytes(small_flux.process.pid)
    resumed = client.resume_memory()
    assert (resumed.released, resumed.changed, resumed.bytes) == (False, True, moved)
    assert vm_rss_bytes(small_flux.process.pid) - emptied >= 0.9 * moved  # the same bound, back
    # The same bytes (the checksum is of the bytes) and the same version; nothing was updated.
    assert (resumed.policy_version, resumed.weights_checksum) == (info.policy_version, info.weights_checksum)
    after = client.server_info()
    assert (after.policy_version, after.weights_checksum, after.memory_released) == (
        info.policy_version,
        info.weights_checksum,
        False,
    )
    answer = httpx.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]}, timeout=WAIT_SECONDS)
    assert answer.status_code == 200 and (answer.json()["sleeping"], answer.json()["changed"]) == (
        False,
        False,
    )
    # Same path: the same server, request and weight bytes, so the same kernels on the same shapes.
    assert same_rollout(before, client.rollout(REQUEST))


def test_a_release_waits_for_the_running_rollout_and_refuses_the_next(small_flux, client):
    """A rollout running when the release comes (held at its prune point) runs to its end first; the
    next one is refused from the release's call on."""
    with ThreadPoolExecutor(1) as pool:
        events = client.stream(HELD)
        started = next(events)
        steps = [next(events), next(events)]  # steps 0 and 1: it is held after step 1's event
        releasing = pool.submit(client.release_memory)
        deadline = time.monotonic() + WAIT_SECONDS
        while not client.server_info().memory_released:  # the release is in
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert_rollout_refused(client, http_url(small_flux))
        assert not releasing.done()  # the held rollout is in the running set
        client.prune(started, [])  # no prune: it goes on
        rest = list(events)
        residency = releasing.result(timeout=WAIT_SECONDS)
    assert [step.index for step in steps] == [0, 1] and sum(isinstance(e, Step) for e in rest) == 1
    assert isinstance(rest[-1], Finished)
    assert (residency.released, residency.changed) == (True, True)
    assert client.resume_memory().changed


def test_a_bad_tags_body_is_a_400_and_changes_nothing(small_flux, client):
    url = http_url(small_flux)
    answer = httpx.post(f"{url}/release_memory_occupation", json={"tags": ["disk"]}, timeout=WAIT_SECONDS)
    assert answer.status_code == 400
    assert answer.json()["success"] is False and answer.json()["violations"][0]["field"] == "tags"
    assert not client.server_info().memory_released


def test_every_rank_releases_and_resumes_under_sp2(cache_dir, tmp_path):
    """Each rank holds its own copy of the weights: the release and the resume reach both, the bytes
    moved are both ranks' (the same on each), and the rollout after is the one before."""
    server = start_server(cache_dir, tmp_path / "sp2.log", "--sp", "2", "--http-port", "0")
    try:
        with RolloutClient(server.address, timeout=WAIT_SECONDS, retry=None) as client:
            before = client.rollout(REQUEST)
            released = client.release_memory()
            per_rank = [int(count) for count in RELEASED_LINE.findall(server.log())]
            assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
            assert (released.changed, released.bytes) == (True, sum(per_rank))
            assert_rollout_refused(client, http_url(server))
            resumed = client.resume_memory()
            assert [int(count) for count in RESTORED_LINE.findall(server.log())] == per_rank
            assert (resumed.changed, resumed.bytes, resumed.weights_checksum) == (
                True,
                released.bytes,
                released.weights_checksum,
            )
            assert same_rollout(before, client.rollout(REQUEST))  # Same path, at SP=2
    finally:
        server.stop()
