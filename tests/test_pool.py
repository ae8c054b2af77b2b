"""RolloutPool over real replica processes: the same trajectories as one server, prompt groups kept
whole, failover with identical noise after a SIGKILL, weight updates fanned out, and a replica that
missed one kept out of routing until the pool replays it."""

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from helpers import TOLERANCE, make_request, start_server, with_lora
from peft import get_peft_model_state_dict

from rollout_client import RolloutClient, RolloutPool

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


def assert_same_trajectories(pooled, alone) -> None:
    assert len(pooled) == len(alone)
    for a, b in zip(pooled, alone, strict=True):
        assert (a.request_id, a.sample_index, a.prompt_index, a.prompt, a.seed) == (
            b.request_id,
            b.sample_index,
            b.prompt_index,
            b.prompt,
            b.seed,
        )
        assert torch.equal(a.latents[0], b.latents[0])  # x_0: the noise is the seed's
        torch.testing.assert_close(a.latents, b.latents, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=TOLERANCE, rtol=0, equal_nan=True)
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


def test_a_replica_killed_mid_rollout_is_replaced_with_identical_noise(replicas, client, cache_dir, tmp_path):
    slow = make_request(FIELDS, prompts=["a red fox"], num_steps=40, height=256, width=256)
    alone = client.rollout(slow)
    pool = RolloutPool([server.address for server in replicas], timeout=60, health_interval=0.2)
    try:
        result = {}
        worker = threading.Thread(target=lambda: result.update(trajectories=pool.rollout(slow)))
        worker.start()
        wait_until(lambda: any(replica.outstanding for replica in pool.replicas))
        victim = next(k for k, replica in enumerate(pool.replicas) if replica.outstanding)
        time.sleep(0.5)  # into the rollout (about 2 s on one core)
        replicas[victim].stop(signal.SIGKILL)
        worker.join(timeout=60)
        assert_same_trajectories(result["trajectories"], alone)
        assert "rollout id=pool-test" not in replicas[victim].log()  # killed before it finished
        assert pool.retries == 1 and pool.replicas[victim].failures == 1
        assert not pool.replicas[victim].healthy

        replicas[victim] = restart(replicas[victim], cache_dir, tmp_path)
        wait_until(lambda: pool.replicas[victim].healthy)  # re-admitted by its health checks
    finally:
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
