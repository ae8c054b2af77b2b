"""RolloutPool over real replica processes: the same trajectories as one server, prompt groups kept
whole, failover with identical noise after a SIGKILL or a SIGSTOP, weight updates fanned out, a
replica that missed one kept out of routing until the pool replays it, and a stopped replica that
blocks neither updates nor the health watcher."""

import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from peft import get_peft_model_state_dict
from support.errors import field_violations
from support.parity import TOLERANCE
from support.requests import make_request
from support.servers import start_server
from support.weights import with_lora

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient, RolloutPool, Started
from rollout_client.trajectory import PathLatents
from rollout_core import wire

FIELDS = {
    "request_id": "pool-test",
    "prompts": ["a red fox", "a lighthouse", "two cats"],
    "samples_per_prompt": 2,
    "base_seed": 7,
    "num_steps": 4,
    "height": 64,
    "width": 64,
}
REQUEST = make_request(FIELDS)
# The pools' stall_seconds here: well above a tiny-flux replica's longest silence on a loaded machine
# (a step at 256 x 256 takes about 30 ms on one core), so only a stopped replica is declared hung.
STALL_SECONDS = 5.0


@pytest.fixture
def replicas(tmp_path, cache_dir, tiny_flux_folder):
    """Two tiny-flux servers, started together."""
    with ThreadPoolExecutor(2) as executor:
        servers = list(
            executor.map(lambda k: start_server(cache_dir, tmp_path / f"replica-{k}.log"), range(2))
        )
    yield servers
    for server in servers:
        server.stop(signal.SIGKILL)


def restart(server, cache_dir, tmp_path):
    """A new server on a dead replica's port (as a supervisor would bring it back)."""
    port = server.address.rsplit(":", 1)[1]
    return start_server(cache_dir, tmp_path / f"restarted-{port}.log", "--port", port)


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def timed_rollout(client, request) -> tuple[list, float]:
    """``client.rollout(request)`` and the seconds it took."""
    started = time.perf_counter()
    trajectories = client.rollout(request)
    return trajectories, time.perf_counter() - started


def rollout_in_the_background(pool, request, solo_seconds: float) -> tuple[threading.Thread, dict, int]:
    """Start ``pool.rollout(request)`` in a thread; return it, the dict its trajectories will be stored
    in, and the index of the replica running it, once the rollout is a quarter of ``solo_seconds`` (its
    time alone on a server like the replicas) under way there: mid-rollout on a CPU of any speed."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(trajectories=pool.rollout(request)))
    worker.start()
    wait_until(lambda: any(replica.outstanding for replica in pool.replicas))
    victim = next(k for k, replica in enumerate(pool.replicas) if replica.outstanding)
    time.sleep(solo_seconds / 4)
    return worker, result, victim


def stacked(latents) -> torch.Tensor:
    """A trajectory's latents as one tensor (a tree leaf's are views of its nodes' buffers)."""
    return latents.stack() if isinstance(latents, PathLatents) else latents


def assert_same_trajectories(pooled, alone, atol: float = TOLERANCE) -> None:
    assert len(pooled) == len(alone)
    for a, b in zip(pooled, alone, strict=True):
        assert (a.request_id, a.sample_index, a.prompt_index, a.prompt, a.seed) == (
            b.request_id,
            b.sample_index,
            b.prompt_index,
            b.prompt,
            b.seed,
        )
        assert a.node_path == b.node_path
        assert torch.equal(a.latents[0], b.latents[0])  # x_0: the noise is the seed's
        torch.testing.assert_close(stacked(a.latents), stacked(b.latents), atol=atol, rtol=0)
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=atol, rtol=0, equal_nan=True)
        assert a.image_png is not None


def test_pool_returns_what_one_server_returns_with_groups_kept_whole(replicas, client):
    alone = client.rollout(REQUEST)
    with RolloutPool([server.address for server in replicas], timeout=60) as pool:
        pooled = pool.rollout(REQUEST)
        assert pool.retries == 0

        # Requests a server would refuse are sent whole and refused as a server refuses them.
        for malformed in ({"prompts": []}, {"prompts": ["a", "b"], "seeds": [1, 2, 3]}):
            with pytest.raises(grpc.RpcError) as refused:
                pool.rollout(make_request(FIELDS, malformed, base_seed=None, samples_per_prompt=None))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A request whose own numbers fail is the caller's error, refused at admission (an x_0 beyond
        # LATENT_RANGE) or mid-rollout (float16 latents that FLOW_SDE's step from sigma 1 - 2^-24 at
        # noise level 3 carries past 65504, see test_nan_guard.py): raised at once, re-run on no
        # other replica, and no replica counted failed (which would take it out of routing).
        float16 = {"sigmas": [1.0, 1 - 2**-24, 0.5, 0.0], "latent_dtype": rollout_pb2.TENSOR_DTYPE_FLOAT16}
        float16.update(num_steps=None, sampler=rollout_pb2.SAMPLER_TYPE_FLOW_SDE, noise_level=3.0)
        x0 = {"initial_latents": wire.initial_latents_bytes(torch.full((6, 16, 16), 1e20))}
        for fields, field in ((x0, "initial_latents"), (float16, "latent_dtype")):
            with pytest.raises(grpc.RpcError) as refused:
                pool.rollout(make_request(FIELDS, fields, request_id="caller-error"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert [violation.field for violation in field_violations(refused.value)] == [field]
        assert pool.retries == 0 and not any(replica.failures for replica in pool.replicas)
        # No seed and no group size: the server's default group size, one request id, one seed each.
        drawn = pool.rollout(make_request(FIELDS, request_id=None, base_seed=None, samples_per_prompt=None))
        group_size = pool.server_info().defaults.samples_per_prompt
        assert [t.prompt_index for t in drawn] == [p for p in range(3) for _ in range(group_size)]
        assert [t.sample_index for t in drawn] == list(range(3 * group_size))
        assert len({t.request_id for t in drawn}) == 1 and len({t.seed for t in drawn}) == 3 * group_size
        assert pool.retries == 0
    assert_same_trajectories(pooled, alone)
    # Each replica logged whole groups (2 samples each), and both took some of the 3.
    served = [re.findall(r"rollout id=pool-test samples=(\d+)", server.log()) for server in replicas]
    assert sorted(len(lines) for lines in served) == [1, 2]
    assert all(samples == "2" for lines in served for samples in lines)


def random_layout_request(rng: random.Random) -> rollout_pb2.RolloutRequest:
    """A cheap request with a random sample layout: 1-3 prompts, samples_per_prompt set or not, seeds
    given (sometimes the wrong number, or repeated), a base seed or neither, an id or none."""
    prompts = ["a red fox", "a kite", "two cats"][: rng.randint(1, 3)]
    fields = {"prompts": prompts, "num_steps": 1, "height": 64, "width": 64, "images": False}
    fields["latents"] = rollout_pb2.LATENT_SELECTION_NONE
    if rng.random() < 0.7:
        fields["samples_per_prompt"] = rng.randint(1, 3)
    count = len(prompts) * fields.get("samples_per_prompt", 1)
    seeding = rng.choice(["seeds", "wrong-count", "repeated", "base_seed", "none"])
    if seeding == "seeds":
        fields["seeds"] = [rng.randrange(2**64) for _ in range(count)]
    elif seeding == "wrong-count":
        fields["seeds"] = [rng.randrange(2**64) for _ in range(count + 1)]
    elif seeding == "repeated":
        fields["seeds"] = [5] * count if count > 1 else [5, 5]
    elif seeding == "base_seed":
        fields["base_seed"] = rng.randrange(2**64)
    if rng.random() < 0.5:
        fields["request_id"] = f"layout-{rng.randrange(1000)}"
    return make_request(fields)


def test_the_pool_lays_requests_out_as_a_server_does(server, client):
    """For random requests, a pool (one replica) and the server alone give the same group sizes,
    seeds, prompt indices and request id, or refuse the same field; a request whose random choices
    (base seed, id) were left to the server is compared as the server resolved it."""
    rng = random.Random(2026)
    with RolloutPool([server.address], timeout=120) as pool:
        for _ in range(16):
            request = random_layout_request(rng)
            try:
                started = next(e for e in client.stream(request) if isinstance(e, Started)).message
            except grpc.RpcError as refused:
                with pytest.raises(grpc.RpcError) as pooled:
                    pool.rollout(request)
                assert pooled.value.code() == refused.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field_violations(pooled.value) == field_violations(refused), request
                continue
            request.request_id = started.resolved.request_id
            if started.resolved.HasField("base_seed"):
                request.base_seed = started.resolved.base_seed
            trajectories = pool.rollout(request)
            assert [t.seed for t in trajectories] == list(started.seeds), request
            assert [t.prompt_index for t in trajectories] == list(started.prompt_indices)
            assert {t.request_id for t in trajectories} == {started.resolved.request_id}


def test_a_replica_killed_mid_rollout_is_replaced_with_identical_noise(replicas, client, cache_dir, tmp_path):
    """A tree rollout of two prompts, killed with its replica, re-runs whole on the other one with the
    same seeds: the same tree, the same noise."""
    branches = [rollout_pb2.Branch(step=2, factor=2), rollout_pb2.Branch(step=20, factor=2)]
    slow = make_request(
        FIELDS,
        prompts=["a red fox", "two cats"],
        samples_per_prompt=1,
        num_steps=40,
        height=256,
        width=256,
        branches=branches,
    )
    alone, solo_seconds = timed_rollout(client, slow)
    assert len(alone) == 8 and alone[0].tree is not None
    pool = RolloutPool([server.address for server in replicas], timeout=60, health_interval=0.2)
    try:
        worker, result, victim = rollout_in_the_background(pool, slow, solo_seconds)
        replicas[victim].stop(signal.SIGKILL)
        worker.join(timeout=60)
        assert_same_trajectories(result["trajectories"], alone)
        assert "rollout id=pool-test" not in replicas[victim].log()  # killed before it finished
        # The tree ran whole on the other replica: one rollout of its 2 roots.
        assert re.findall(r"rollout id=pool-test samples=(\d+)", replicas[1 - victim].log()) == ["2"]
        assert pool.retries == 1 and pool.replicas[victim].failures == 1
        assert not pool.replicas[victim].healthy

        replicas[victim] = restart(replicas[victim], cache_dir, tmp_path)
        wait_until(lambda: pool.replicas[victim].healthy)  # re-admitted by its health checks
    finally:
        pool.close()


def test_a_replica_stopped_mid_rollout_is_replaced_with_bitwise_the_same_numbers(replicas, client):
    """Without a timeout nothing but the stall rule ends a call to a stopped replica: the pool declares
    it hung, re-runs its group on the other replica (alone there, as the solo run was: bitwise the
    same), and routes to it again after SIGCONT once a probe rollout has completed on it."""
    slow = make_request(FIELDS, prompts=["a red fox"], num_steps=40, height=256, width=256)
    alone, solo_seconds = timed_rollout(client, slow)
    pool = RolloutPool(
        [server.address for server in replicas], health_interval=0.2, stall_seconds=STALL_SECONDS
    )
    victim = None
    try:
        worker, result, victim = rollout_in_the_background(pool, slow, solo_seconds)
        replicas[victim].process.send_signal(signal.SIGSTOP)
        worker.join(timeout=30)  # stall_seconds, then the re-run: a few seconds
        assert "trajectories" in result, "the pool still waits on the stopped replica"
        assert_same_trajectories(result["trajectories"], alone, atol=0)
        assert pool.retries == 1 and pool.replicas[victim].failures == 1
        assert pool.replicas[victim].hangs == 1 and not pool.replicas[victim].healthy

        replicas[victim].process.send_signal(signal.SIGCONT)
        wait_until(lambda: pool.replicas[victim].healthy)
        outcomes = re.findall(r"rollout id=(pool-\w+) .* status=(\w+)", replicas[victim].log())
        # Stopped before it finished, cancelled; then the probe it passed to route again.
        assert outcomes == [("pool-test", "CANCELLED"), ("pool-probe", "OK")]
    finally:
        if victim is not None:
            replicas[victim].process.send_signal(signal.SIGCONT)
        pool.close()


def updates_queued(server, version: int) -> int:
    """How many updates to ``version`` the server has queued behind its running rollouts."""
    return server.log().count(f"weight update to version {version} queued")


def test_a_stopped_replica_blocks_neither_updates_nor_the_watcher_and_is_caught_up_after(
    replicas, tiny_transformer
):
    """Replica 0 stops twice with an update in flight to it: once under a fan-out, once under the
    watcher's replay of what it missed. Each time the pool goes on without it (an update returns,
    another replica's death is noticed) and, after SIGCONT, it is caught up and routes again."""
    stopped = replicas[0]
    adapted, config = with_lora(tiny_transformer, trained=True)
    adapter = get_peft_model_state_dict(adapted)
    pool = RolloutPool(
        [server.address for server in replicas], timeout=60, health_interval=0.2, stall_seconds=STALL_SECONDS
    )
    direct = RolloutClient(stopped.address)
    try:
        # A rollout the pool did not send holds replica 0's update barrier: its stream is not read,
        # so the server parks it (ending it only after its own --stall-seconds, 60).
        held = direct.stub.Rollout(
            make_request(FIELDS, request_id="held", prompts=["a kite"], num_steps=100, height=512, width=512)
        )
        next(held)  # it runs

        # Replica 0 stops while the fan-out of version 1 waits on it.
        outcome = {}
        update = threading.Thread(
            target=lambda: outcome.update(response=pool.update_weights(adapter, 1, lora_config=config))
        )
        update.start()
        wait_until(lambda: updates_queued(stopped, 1) == 1)
        stopped.process.send_signal(signal.SIGSTOP)
        update.join(timeout=30)  # stall_seconds, then the other replica's answer
        assert "response" in outcome, "update_weights still waits on the stopped replica"
        assert outcome["response"].policy_version == pool.version == 1
        assert not pool.replicas[0].healthy and pool.replicas[0].hangs == 1

        # It resumes; the watcher replays version 1 to it, behind the held rollout; it stops again.
        stopped.process.send_signal(signal.SIGCONT)
        wait_until(lambda: updates_queued(stopped, 1) == 2)
        stopped.process.send_signal(signal.SIGSTOP)
        assert pool.update_weights(adapter, 2, lora_config=config).policy_version == 2
        replicas[1].stop(signal.SIGKILL)
        wait_until(lambda: not pool.replicas[1].healthy, seconds=15)  # a health check: 4 s at most

        stopped.process.send_signal(signal.SIGCONT)
        held.cancel()
        wait_until(lambda: pool.replicas[0].healthy)
        assert direct.server_info().policy_version == 2  # both updates replayed
        assert "rollout id=pool-probe samples=1 steps=1" in stopped.log()
        assert {t.policy_version for t in pool.rollout(REQUEST)} == {2}
    finally:
        stopped.process.send_signal(signal.SIGCONT)
        direct.close()
        pool.close()


def test_updates_reach_every_replica_and_one_that_missed_an_update_waits_for_its_replay(
    replicas, cache_dir, tmp_path, tiny_transformer
):
    pool = RolloutPool([server.address for server in replicas], timeout=60, health_interval=0.2)
    try:
        adapted, config = with_lora(tiny_transformer, trained=True)
        adapter = get_peft_model_state_dict(adapted)
        assert pool.update_weights(adapter, 1, lora_config=config).policy_version == 1
        infos = pool.server_infos()
        assert [info.policy_version for info in infos.values()] == [1, 1]
        assert all(len(info.lora_adapter.modules) == len(adapter) // 2 for info in infos.values())

        # The second replica dies, misses version 2, and comes back at version 0.
        replicas[1].stop(signal.SIGKILL)
        wait_until(lambda: not pool.replicas[1].healthy)
        full = {name: tensor + 0.01 for name, tensor in tiny_transformer.state_dict().items()}
        pool.update_weights(full, 2)
        assert pool.version == 2 and pool.replicas[1].version == 1
        replicas[1] = restart(replicas[1], cache_dir, tmp_path)
        with RolloutClient(replicas[1].address) as direct:
            assert direct.server_info().policy_version in (0, 2)  # restarted, or already replayed
            wait_until(lambda: pool.replicas[1].healthy)
            assert direct.server_info().policy_version == 2  # the pool replayed the full update
            assert not direct.server_info().HasField("lora_adapter")  # which removed the adapter
        for trajectory in pool.rollout(REQUEST):
            assert trajectory.policy_version == 2
        served = [re.findall(r"rollout id=pool-test samples=2", server.log()) for server in replicas]
        assert all(served)
    finally:
        pool.close()


def test_a_replica_behind_the_pool_is_not_routed_to(replicas, tiny_transformer):
    with RolloutClient(replicas[0].address) as ahead:
        ahead.update_weights(
            {
                "transformer_blocks.0.attn.to_q.weight": tiny_transformer.state_dict()[
                    "transformer_blocks.0.attn.to_q.weight"
                ].clone()
            },
            1,
            kind="subset",
        )
    with RolloutPool([server.address for server in replicas], timeout=60, wait_seconds=2) as pool:
        assert pool.version == 1
        assert [replica.healthy for replica in pool.replicas] == [True, False]
        for trajectory in pool.rollout(REQUEST):
            assert trajectory.policy_version == 1  # never the replica at version 0
        # The pool holds no update to bring it to version 1: it stays out.
        time.sleep(2.5)
        assert not pool.replicas[1].healthy
