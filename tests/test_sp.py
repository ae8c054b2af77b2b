"""Sequence parallelism over two gloo ranks: the same request at SP=1 and SP=2 gives
bitwise-equal noise and (with float32 latents) log-probs, latents and velocities within 1e-5, and a
replayable stream; a rank that dies turns into a clear error and a non-zero exit, never a hang."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from support.parity import assert_replays, assert_same_numbers
from support.requests import make_request, split_events
from support.servers import SERVER_THREADS, metrics_url, scrape, start_server

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client import RolloutClient
from rollout_core import wire
from rollout_core.local_server import LocalServer
from rollout_server.parallel import ParallelDims, SequenceParallel

EPS, VELOCITY = rollout_pb2.DEBUG_TENSOR_EPS, rollout_pb2.DEBUG_TENSOR_VELOCITY
RANK_READY = re.compile(r"rank (?P<rank>\d+) of 2 ready \(pid (?P<pid>\d+)")


SP_REQUEST = {
    "prompts": ["a red fox in the snow", "two cats"],
    "samples_per_prompt": 2,
    "base_seed": 17,
    "height": 64,
    "width": 64,
    "num_steps": 4,
    "debug_tensors": [EPS, VELOCITY],
    "images": False,
}


def request(**fields) -> rollout_pb2.RolloutRequest:
    return make_request(SP_REQUEST, fields)


@pytest.fixture(scope="module")
def sp2_server(tiny_flux_folder, cache_dir, tmp_path_factory):
    server = start_server(
        cache_dir, tmp_path_factory.mktemp("sp") / "sp2.log", "--sp", "2", "--metrics-port", "0"
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def sp2_client(sp2_server):
    with RolloutClient(sp2_server.address, timeout=300) as rollout_client:
        yield rollout_client


@pytest.mark.parametrize("sampler", [rollout_pb2.SAMPLER_TYPE_FLOW_SDE, rollout_pb2.SAMPLER_TYPE_CPS])
def test_sp2_matches_sp1(client, sp2_client, tiny_transformer, sampler):
    one = split_events(client.stream(request(sampler=sampler)))
    two = split_events(sp2_client.stream(request(sampler=sampler)))
    assert (two.started.message.sp_degree, two.started.message.attention_split) == (2, "ulysses")
    assert (one.started.message.sp_degree, one.started.message.attention_split) == (1, "none")
    assert_same_numbers(one, two, bitwise_log_probs=True)
    assert_replays(tiny_transformer, two.trajectories())  # with a plain, unsplit transformer


def test_sp2_takes_a_trainers_schedule_and_x0_as_sp1(client, sp2_client):
    """A trainer's sigmas and x_0 reach every rank (they travel in the request): the SP=2 stream starts
    from that x_0 on that schedule, with the numbers of SP=1."""
    x0 = 0.5 * split_events(client.stream(request())).started.x0
    fields = {"sigmas": [1.0, 0.9, 0.8, 0.4, 0.0], "initial_latents": wire.initial_latents_bytes(x0)}
    one = split_events(
        client.stream(request(stochastic_steps=[0, 1], solver=rollout_pb2.SOLVER_DPMPP_2M, **fields))
    )
    two = split_events(
        sp2_client.stream(request(stochastic_steps=[0, 1], solver=rollout_pb2.SOLVER_DPMPP_2M, **fields))
    )
    assert torch.equal(two.started.x0, x0) and list(two.started.message.sigmas) == list(
        one.started.message.sigmas
    )
    assert_same_numbers(one, two, bitwise_log_probs=True)


def test_sp2_tree_matches_sp1(client, sp2_client, tiny_transformer):
    """A tree rollout at SP=2: the same nodes at every step, and the numbers of SP=1."""
    forks = [rollout_pb2.Branch(step=1, factor=2), rollout_pb2.Branch(step=2, factor=2, noise_level=1.1)]
    tree = request(samples_per_prompt=1, branches=forks)
    one = split_events(client.stream(tree))
    two = split_events(sp2_client.stream(tree))
    assert [step.nodes for step in one.steps] == [step.nodes for step in two.steps]
    assert len(two.steps[-1].nodes) == 2 * 4
    assert_same_numbers(one, two, bitwise_log_probs=True)
    assert_replays(tiny_transformer, two.trajectories())


def test_torchrun_launch_matches_sp1(client, cache_dir, tmp_path):
    """``torchrun --nproc-per-node 2 -m rollout_server serve`` forms the same 2-rank group."""
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node", "2")
    server = LocalServer.start(
        tmp_path / "torchrun.log",
        "--cache-dir",
        str(cache_dir),
        "--threads",
        SERVER_THREADS,
        launcher=torchrun,
    )
    try:
        with RolloutClient(server.address, timeout=300) as torchrun_client:
            assert torchrun_client.server_info().sp_degree == 2
            launched = torchrun_client.rollout(request(num_steps=3))
    finally:
        server.stop()  # torchrun answers its own SIGTERM with exit code 1: only the shutdown is checked
    for trajectory, reference in zip(launched, client.rollout(request(num_steps=3)), strict=True):
        assert torch.equal(trajectory.log_probs, reference.log_probs)
        torch.testing.assert_close(trajectory.latents, reference.latents, atol=1e-5, rtol=0)


def test_server_info_reports_the_split(sp2_client):
    info = sp2_client.server_info()
    assert (info.sp_degree, info.attention_split) == (2, "ulysses")


def test_sp2_batching_concurrent_requests_matches_sp1(client, sp2_client):
    """Mixed requests (samplers, CFG on and off, group sizes) sent together to the SP=2 server share
    forwards, and each streams what it streams alone at SP=1: noise and log-probs bitwise, latents
    within 1e-5."""
    requests = {
        # A stochastic window between steps of a multistep solver: its history on both ranks.
        "flow": request(base_seed=101, num_steps=6, stochastic_steps=[1, 2], solver=rollout_pb2.SOLVER_UNIPC),
        "cps-cfg": request(
            base_seed=202,
            num_steps=7,
            sampler=rollout_pb2.SAMPLER_TYPE_CPS,
            true_cfg_scale=2.5,
            negative_prompt="blurry",
        ),
        "dance": request(
            prompts=["a lighthouse"],
            samples_per_prompt=3,
            base_seed=303,
            sampler=rollout_pb2.SAMPLER_TYPE_DANCE,
        ),
    }
    together = {}
    gate = threading.Barrier(len(requests))

    def run(name: str) -> None:
        gate.wait()
        together[name] = split_events(sp2_client.stream(requests[name]))

    threads = [threading.Thread(target=run, args=(name,)) for name in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(together) == sorted(requests)
    assert sum(rollout.finished.message.shared_steps for rollout in together.values()) > 0
    for name, rollout_request in requests.items():
        alone = split_events(client.stream(rollout_request))
        # Velocities differ by the model's rounding at another batch size, latents within 1e-5.
        assert_same_numbers(alone, together[name], bitwise_log_probs=True)


def admitted_and_refused(server) -> tuple[float, float]:
    samples = scrape(metrics_url(server))
    admitted = sum(value for (name, _), value in samples.items() if name == "rollout_server_rollouts_total")
    refused = samples.get(("rollout_server_rejected_requests_total", (("reason", "invalid_argument"),)), 0.0)
    return admitted, refused


def test_unsplittable_shape_is_invalid_argument(sp2_server, sp2_client):
    """48 x 48 pixels is 9 image tokens: they cannot be split over 2 ranks. Validation refuses the
    request before it is queued: it is counted as refused, never as an admitted rollout."""
    admitted, refused = admitted_and_refused(sp2_server)
    with pytest.raises(grpc.RpcError) as raised:
        sp2_client.rollout(request(height=48, width=48))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "height" in raised.value.details() and "do not split evenly across 2 ranks" in raised.value.details()
    )
    assert admitted_and_refused(sp2_server) == (admitted, refused + 1)
    assert sp2_client.rollout(request(num_steps=2))  # still serving, ranks still in step


def test_ranks_fork_before_torch_starts_its_thread_pools(tmp_path):
    """--sp 2 --threads 4 on an empty cache: the ranks are forked before torch's thread pools start
    (``--threads``, then the preset's build): a fork made after them hangs in its first parallel
    kernel, or fails in it, and the rollout with it."""
    flags = ("--model", "tiny-wan", "--sp", "2", "--threads", "4")
    server = start_server(tmp_path / "empty-cache", tmp_path / "sp2.log", *flags)
    try:
        with RolloutClient(server.address, timeout=60) as fresh:
            assert len(fresh.rollout(request(num_steps=2))) == 4
    finally:
        assert server.stop() == 0


def test_killed_rank_ends_the_stream_and_the_server(cache_dir, tmp_path):
    timeout = 20
    server = start_server(cache_dir, tmp_path / "kill.log", "--sp", "2", "--collective-timeout", str(timeout))
    ranks = {int(m["rank"]): int(m["pid"]) for m in RANK_READY.finditer(server.log())}
    assert set(ranks) == {0, 1}
    with grpc.insecure_channel(server.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        stream = stub.Rollout(request(num_steps=100, height=256, width=256), timeout=120)
        assert next(stream).WhichOneof("event") == "started"
        assert next(stream).WhichOneof("event") == "step"
        killed_at = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as raised:
            for _ in stream:
                pass
    assert raised.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    assert "rank 1" in raised.value.details()
    assert time.monotonic() - killed_at < timeout + 5
    assert server.process.wait(timeout=timeout + 30) != 0


def test_a_failure_names_a_rank_whose_process_is_still_exiting():
    """A collective fails as soon as a dead rank's sockets close, which can be before its process
    has exited: the error still names the rank (here one that exits 0.3 s after the failure)."""
    rank_1 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(3)"])
    try:
        two_ranks = SequenceParallel(ParallelDims(sp=2, world_size=2), helpers=[rank_1])
        assert two_ranks.describe_failure() == "rank 1 exited with 3; "
    finally:
        rank_1.kill()
        rank_1.wait()
