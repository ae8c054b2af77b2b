"""Prometheus metrics of a real server, scraped over HTTP around real calls."""

import math

import grpc
import pytest
from support.servers import metrics_url, scrape, start_server
from support.weights import TO_Q

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client import RolloutClient
from rollout_core.tree import Tree
from rollout_server.limits import Limits

TOKEN = "metrics-test-token"
STEPS = 3
REQUEST = rollout_pb2.RolloutRequest(
    prompts=["a red fox"], samples_per_prompt=2, height=64, width=64, num_steps=STEPS
)


@pytest.fixture(scope="module")
def metered_server(tiny_flux_folder, cache_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("metered")
    token_file = folder / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    server = start_server(
        cache_dir, folder / "server.log", "--metrics-port", "0", "--auth-token-file", str(token_file)
    )
    yield server
    assert server.stop() == 0


def test_metrics_count_what_was_done(metered_server, tiny_transformer):
    """A rollout, an invalid request, a call without a token and a weight update move exactly the
    counters they should, and the gauges show the idle server at the pushed policy version."""
    url = metrics_url(metered_server)
    before = scrape(url)

    with RolloutClient(metered_server.address, timeout=120, token=TOKEN) as client:
        stub = rollout_pb2_grpc.RolloutServiceStub(client.channel)
        messages = list(stub.Rollout(REQUEST, metadata=client.metadata, timeout=120))
        with pytest.raises(grpc.RpcError) as invalid:
            client.rollout(prompts=["a red fox"], height=72)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        version = client.server_info().policy_version + 1
        subset = {TO_Q: tiny_transformer.state_dict()[TO_Q].clone()}
        update = client.update_weights(subset, version, kind="subset")
    with (
        RolloutClient(metered_server.address, timeout=120) as anonymous,
        pytest.raises(grpc.RpcError) as refused,
    ):
        anonymous.server_info()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    after = scrape(url)

    def moved(name: str, **labels) -> float:
        key = (f"rollout_server_{name}", tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    started = messages[0].started
    rows = len(started.transformer_call.branches) * len(started.seeds)  # per step
    assert moved("rollouts_total", status="OK") == 1
    assert moved("steps_total") == STEPS
    assert moved("step_seconds_count") == STEPS and moved("step_seconds_sum") > 0
    assert moved("rollouts_per_step_sum") == STEPS  # it ran alone
    assert moved("rows_per_forward_count") == STEPS * math.ceil(rows / Limits.max_batch_size)
    assert moved("rows_per_forward_sum") == STEPS * rows
    assert moved("streamed_bytes_total") == sum(message.ByteSize() for message in messages)
    assert moved("rejected_requests_total", reason="invalid_argument") == 1
    assert moved("rejected_requests_total", reason="unauthenticated") == 1
    assert moved("rejected_requests_total", reason="permission_denied") == 0
    assert moved("weight_update_seconds_count") == 1
    assert moved("weight_update_bytes_total") == update.bytes > 0
    assert after[("rollout_server_policy_version", ())] == version
    assert after[("rollout_server_in_flight_rollouts", ())] == 0
    assert after[("rollout_server_queue_depth", ())] == 0
    assert after[("rollout_server_running_rollouts", ())] == 0


def test_the_nodes_of_a_tree_at_one_step_share_forwards(metered_server):
    """A tree rollout alone: at each step its nodes' rows run in the fewest forwards of at most
    --max-batch-size rows, not one forward per node or per leaf."""
    forks = [rollout_pb2.Branch(step=0, factor=2), rollout_pb2.Branch(step=2, factor=3)]
    tree_request = rollout_pb2.RolloutRequest(
        prompts=["a red fox", "two cats"],
        samples_per_prompt=1,
        height=64,
        width=64,
        num_steps=5,
        branches=forks,
        images=False,
    )
    url = metrics_url(metered_server)
    before = scrape(url)
    with RolloutClient(metered_server.address, timeout=120, token=TOKEN) as client:
        events = list(client.stream(tree_request))
    after = scrape(url)
    started, finished = events[0].message, events[-1].message
    tree = Tree.from_proto(started.tree, 5)
    owners = [len(tree.owners(i)) for i in range(5)]  # the distinct latents each step's forward takes
    assert owners == [2, 4, 4, 12, 12]
    forwards = sum(math.ceil(count / Limits.max_batch_size) for count in owners)
    moved = {
        name: after[(f"rollout_server_{name}", ())] - before.get((f"rollout_server_{name}", ()), 0.0)
        for name in ("rows_per_forward_count", "rows_per_forward_sum")
    }
    assert moved == {"rows_per_forward_count": forwards, "rows_per_forward_sum": sum(owners)}
    assert finished.transformer_rows == sum(owners) == 34  # 5 steps x 12 leaves flat: 60
