"""The client's transport has one owner: ``RolloutClient.call`` (its timeout and token), ``health`` and
``prune`` against a real server; weight updates built once (``WeightsUpdate``, ``from_weights``); and
one failure taxonomy (``rollout_client.failures``), its table and its sets in agreement."""

import inspect
import re
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from support.families import family_request

from rollout.v1 import rollout_pb2
from rollout_client import RetryPolicy, RolloutClient, Step, failures
from rollout_client.events import decode_stream
from rollout_client.routing import ReplicaHung
from rollout_client.updates import WeightsUpdate, from_weights

Code = grpc.StatusCode


def held_request(request_id: str) -> rollout_pb2.RolloutRequest:
    """A tree rollout of 3 steps held after step 0 until its caller prunes."""
    return family_request(
        "flux",
        "FLOW_SDE",
        False,
        request_id=request_id,
        samples_per_prompt=1,
        num_steps=3,
        branches=[rollout_pb2.Branch(step=1, factor=2)],
        prune_points=[0],
    )


def test_the_client_checks_health_and_prunes_through_its_own_calls(client):
    assert client.health() == health_pb2.HealthCheckResponse.SERVING
    stream = client.stream(held_request("transport-held"))
    started = next(stream)
    assert next(stream).index == 0  # held after step 0, until its caller's prune
    answer = client.prune(started)  # the explicit "no prune"
    assert isinstance(answer, rollout_pb2.PruneRolloutResponse)
    assert list(answer.nodes) == [] and answer.step == 1
    assert [event.index for event in stream if isinstance(event, Step)] == [1, 2]


def test_a_calls_own_timeout_replaces_the_clients(server):
    """A rollout held for its caller outlives the client's 1 s timeout only under a timeout of its own."""
    with RolloutClient(server.address, timeout=1.0) as hasty:
        with pytest.raises(grpc.RpcError) as raised:
            list(hasty.stream(held_request("transport-deadline")))
        assert raised.value.code() == Code.DEADLINE_EXCEEDED
        stream = decode_stream(hasty.call("Rollout", held_request("transport-patient"), timeout=60))
        started = next(stream)
        assert next(stream).index == 0
        time.sleep(1.5)  # held past the client's timeout
        assert hasty.prune(started).step == 1
        assert [event.index for event in stream if isinstance(event, Step)] == [1, 2]


class Recorder:
    """Pushes nothing: answers what ``update_weights`` built."""

    def push(self, update: WeightsUpdate, progress: bool = True) -> tuple[WeightsUpdate, bool]:
        return update, progress

    update_weights = from_weights(push)


def test_update_weights_builds_one_weights_update_and_passes_the_rest_on():
    weights = {"w": torch.zeros(1)}
    update, progress = Recorder().update_weights(weights, 3, "subset", progress=False)
    assert (update.weights, update.version, update.kind, update.resolved_kind, progress) == (
        weights,
        3,
        "subset",
        "subset",
        False,
    )
    update, progress = Recorder().update_weights(
        weights, 4, lora_config={"r": 4}, adapter_name="a", target="t"
    )
    assert (update.resolved_kind, update.adapter_name, update.target, progress) == ("lora", "a", "t", True)
    header = update.header()
    assert (header.policy_version, header.kind, header.adapter_name, header.target) == (
        4,
        rollout_pb2.WEIGHTS_KIND_LORA,
        "a",
        "t",
    )
    assert header.lora_config_json == '{"r": 4}'
    assert WeightsUpdate(weights, 5).header().kind == rollout_pb2.WEIGHTS_KIND_FULL
    with pytest.raises(TypeError):
        Recorder().update_weights(weights, 5, unknown=1)
    assert inspect.signature(Recorder.update_weights).return_annotation == tuple[WeightsUpdate, bool]


def test_a_snapshot_keeps_the_tensors_as_they_were():
    weights = {"w": torch.zeros(2)}
    snapshot = WeightsUpdate(weights, 1, "subset").snapshot()
    weights["w"].add_(1)
    assert snapshot.weights["w"].tolist() == [0.0, 0.0] and snapshot.kind == "subset"


def table_rows() -> dict[Code, tuple[bool, bool, bool]]:
    """The module docstring's table: each code's (channel retry, replica failure, server failure)."""
    rows = {}
    for line in failures.__doc__.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"[A-Z_, ]+", cells[0]):
            for name in cells[0].split(", "):
                rows[Code[name]] = tuple(cell == "yes" for cell in cells[2:])
    return rows


def test_the_failure_table_and_sets_agree():
    rows = table_rows()
    assert {code for code, (retry, _, _) in rows.items() if retry} == set(failures.CHANNEL_RETRIES)
    assert {code for code, (_, replica, _) in rows.items() if replica} == failures.REPLICA_FAILURES
    assert {code for code, (_, _, server) in rows.items() if server} == failures.SERVER_FAILURES
    assert failures.REFUSED_CREDENTIALS <= failures.CALLER_ERRORS
    assert set(Code) - {Code.OK} == failures.CALLER_ERRORS | failures.SERVER_FAILURES
    assert not failures.CALLER_ERRORS & failures.SERVER_FAILURES
    assert {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.NOT_FOUND} <= failures.CALLER_ERRORS


def test_the_channel_and_the_pool_read_the_taxonomy():
    assert RetryPolicy().codes == failures.CHANNEL_RETRIES
    assert ReplicaHung("10.0.0.1:1", 5).code() in failures.REPLICA_FAILURES
