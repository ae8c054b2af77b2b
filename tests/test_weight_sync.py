"""Weight sync over a torch.distributed group, on real processes: this test process is the trainer
(rank 0 of a gloo group), with an SP=2 server and a single-rank replica in the same group. FULL,
SUBSET and LoRA updates through it; every rank's checksum is the trainer's; rollouts replay on the new
weights; bad manifests refused before a byte moves; a trainer killed or stalled mid-broadcast leaves
the old weights serving and the group re-creatable. Plus the checksum and bucket rules against
independent references."""

import copy
import re
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from support.errors import field_violations, health_status
from support.parity import assert_replays
from support.servers import start_server
from support.weights import next_version, perturbed, with_lora

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient, RolloutPool, WeightSyncGroup
from rollout_core import buckets, checksum

FULL = rollout_pb2.WEIGHTS_KIND_FULL
REQUEST = {"prompts": ["a kite"], "samples_per_prompt": 2, "base_seed": 3, "height": 64, "width": 64}
REQUEST.update(num_steps=3, images=False)


@pytest.fixture(scope="module")
def servers(cache_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("weight-sync")
    sp2 = start_server(cache_dir, logs / "sp2.log", "--model", "tiny-flux", "--sp", "2")
    single = start_server(cache_dir, logs / "single.log", "--model", "tiny-flux")
    yield sp2, single
    for server in (sp2, single):
        server.stop()


@pytest.fixture(scope="module")
def clients(servers):
    made = [RolloutClient(server.address, timeout=120) for server in servers]
    yield made
    for client in made:
        client.close()


@pytest.fixture(scope="module")
def base(family_resources):
    """The trainer's transformer as loaded (each test copies it)."""
    return family_resources.transformer("flux")


def served(model: torch.nn.Module, adapter: dict | None = None) -> str:
    """The checksum a server reports when it serves ``model`` (and its LoRA ``adapter``)."""
    tensors = checksum.policy_tensors(
        {"transformer": checksum.base_tensors(model)}, {"transformer": adapter} if adapter else None
    )
    return checksum.weights_checksum(tensors)


def assert_serves(clients: list[RolloutClient], version: int, expected: str) -> None:
    for client in clients:
        info = client.server_info()
        assert (info.policy_version, info.weights_checksum) == (version, expected)


# The rules, against independent references ----------------------------------------------------------


def reference_digest(tensor: torch.Tensor) -> tuple[int, int]:
    """(A, B) of rollout_core.checksum's docstring, in Python integers from numpy's int32 words."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    words = np.frombuffer(raw + bytes(-len(raw) % 4), dtype="<i4").astype(object)
    total = int(sum(words))
    weighted = int(sum((i + 1) * int(w) for i, w in enumerate(words)))
    return total % checksum.MODULUS, weighted % checksum.MODULUS


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3 * checksum.ROW_WORDS + 17, generator=torch.Generator().manual_seed(0)),
        torch.randn(301, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        torch.arange(7, dtype=torch.uint8),
        torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32).repeat(checksum.ROW_WORDS + 1),
        torch.empty(0),
    ],
    ids=["float32-rows", "bfloat16-odd", "uint8-tail", "int32-extremes", "empty"],
)
def test_checksum_digest_matches_its_formula(tensor):
    assert checksum.tensor_digest(tensor) == reference_digest(tensor)


def test_checksum_rows_sum_alike_in_numpy_and_torch():
    """The CPU's numpy rows and an accelerator's torch rows (run here on the CPU) are the same integers."""
    words = torch.randint(-(2**31), 2**31 - 1, (20 * checksum.ROW_WORDS,), dtype=torch.int32)
    rows = words.numel() // checksum.ROW_WORDS
    assert list(checksum._cpu_row_sums(words, rows)) == list(checksum._device_row_sums(words, rows))


def test_checksum_sees_a_moved_value_and_a_rename():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    moved = values.clone()
    moved[[3, 700]] = moved[[700, 3]]
    assert checksum.tensor_digest(moved)[0] == checksum.tensor_digest(values)[0]  # A alone cannot
    assert checksum.weights_checksum({"w": moved}) != checksum.weights_checksum({"w": values})
    assert checksum.weights_checksum({"v": values}) != checksum.weights_checksum({"w": values})
    view = torch.randn(10, 10)[:, 3]  # not contiguous
    assert checksum.weights_checksum({"w": view}) == checksum.weights_checksum({"w": view.clone()})


def test_bucket_layout_aligns_tensors_and_refuses_gaps():
    sizes = [10, 100, 1000, 3]
    assert buckets.assign(sizes, 256) == [0, 0, 1, 2]
    first, second, third = buckets.layout(sizes, [0, 0, 1, 2])
    assert [(p.offset, p.nbytes) for p in first.tensors] == [(0, 10), (64, 100)]
    assert first.nbytes == 164 and second.nbytes == 1000 and third.nbytes == 3
    for wrong, message in (
        ([1, 1, 1, 1], "tensors[0].bucket is 1, must be 0"),
        ([0, 2, 2, 2], "tensors[1].bucket is 2, must be 0 or 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            buckets.layout(sizes, wrong)


# Updates through one group ----------------------------------------------------------------------------


def test_full_subset_and_lora_reach_every_rank_of_both_replicas(clients, base):
    with RolloutPool([client.address for client in clients], timeout=120) as pool:
        group = pool.init_weight_sync(timeout=60)
        assert group.world_size == 4 and group.rank_offsets == [1, 3]
        for client, offset, ranks in zip(clients, (1, 3), (2, 1), strict=True):
            joined = client.server_info().weight_sync
            assert (joined.rank_offset, joined.ranks, joined.world_size) == (offset, ranks, 4)

        trained = perturbed(base, seed=11)
        version = next_version(clients[0])
        applied = pool.update_weights_from_group(trained.state_dict(), version)
        assert (applied.tensors, applied.total_tensors) == (len(trained.state_dict()),) * 2
        assert_serves(clients, version, served(trained))
        assert pool.version == version and all(r.version == version for r in pool.replicas)
        # Both ranks of the SP server computed the trainer's checksum (the group checks every rank's).
        assert list(applied.rank_checksums) == [served(trained)] * 2
        for client in clients:
            assert_replays(trained, client.rollout(**REQUEST))

        subset = perturbed(trained, seed=12)
        names = [name for name in subset.state_dict() if ".attn." in name]
        version += 1
        changed = {name: subset.state_dict()[name] for name in names}
        applied = pool.update_weights_from_group(changed, version, "subset")
        assert (applied.tensors, applied.total_tensors) == (len(names), len(trained.state_dict()))
        trained.load_state_dict(changed, strict=False)
        assert_serves(clients, version, served(trained))

        adapted, config = with_lora(trained, trained=True)
        adapter = get_peft_model_state_dict(adapted)
        version += 1
        expected = served(trained, adapter)
        outcomes = group.update(adapter, version, lora_config=config, expect_checksum=expected)
        assert [len(o.applied.rank_checksums) for o in outcomes] == [2, 1]
        assert {c for o in outcomes for c in o.applied.rank_checksums} == {expected}
        for client in clients:
            assert client.server_info().lora_adapter.tensors == len(adapter)
            assert_replays(adapted, client.rollout(**REQUEST))
        group.close()
        assert not any(client.server_info().HasField("weight_sync") for client in clients)


def test_grpc_updates_report_the_checksum_of_what_they_applied(clients, base):
    """The checksum UpdateWeights answers with, read from the served tensors, is the trainer's for
    FULL, SUBSET and LoRA."""
    client = clients[1]
    trained = perturbed(base, seed=31)
    version = next_version(client)
    assert client.update_weights(trained.state_dict(), version).weights_checksum == served(trained)
    name = next(iter(trained.state_dict()))
    changed = {name: trained.state_dict()[name] * 2}
    trained.load_state_dict(changed, strict=False)
    assert client.update_weights(changed, version + 1, "subset").weights_checksum == served(trained)
    adapted, config = with_lora(trained, trained=True)
    adapter = get_peft_model_state_dict(adapted)
    response = client.update_weights(adapter, version + 2, lora_config=config)
    assert response.weights_checksum == client.server_info().weights_checksum == served(trained, adapter)


def raw_update(client: RolloutClient, manifest: rollout_pb2.GroupUpdateManifest):
    """An UpdateWeightsFromGroup call that sends the manifest alone; the server's first answer."""
    request = rollout_pb2.UpdateWeightsFromGroupRequest(manifest=manifest)
    return next(client.stub.UpdateWeightsFromGroup(iter([request]), timeout=30))


def test_bad_manifests_are_refused_before_any_byte_moves(clients, base):
    client = clients[1]
    group = WeightSyncGroup([client], timeout=30)
    before = client.server_info()
    version = before.policy_version + 1
    state = base.state_dict()
    name, tensor = next(iter(state.items()))

    def manifest(*tensors: rollout_pb2.GroupTensor, kind=rollout_pb2.WEIGHTS_KIND_SUBSET, version=version):
        header = rollout_pb2.WeightsUpdateHeader(policy_version=version, kind=kind)
        return rollout_pb2.GroupUpdateManifest(header=header, tensors=tensors)

    def entry(name=name, dtype="F32", shape=tuple(tensor.shape), bucket=0):
        return rollout_pb2.GroupTensor(name=name, dtype=dtype, shape=shape, bucket=bucket)

    shape = "manifest.tensors[0].shape"
    cases = {
        "unknown name": (manifest(entry(name="blocks.9.nothing")), "manifest.tensors", "unknown tensor"),
        "wrong shape": (manifest(entry(shape=(3, 3))), "manifest.tensors", "has shape [3, 3]"),
        "wrong dtype": (manifest(entry(dtype="BF16")), "manifest.tensors", "torch.bfloat16"),
        "duplicate": (manifest(entry(), entry(bucket=1)), "manifest.tensors[1].name", "listed twice"),
        "bucket gap": (manifest(entry(bucket=2)), "manifest.tensors[0].bucket", "must be 0"),
        "not a dtype": (manifest(entry(dtype="F8")), "manifest.tensors[0].dtype", "must be one of"),
        "over the limit": (manifest(entry(shape=(2**40, 2**20))), shape, "above the limit"),
        # Its size overflows 64 bits: refused from the sizes, before any tensor (even a meta one) is made.
        "overflowing": (manifest(entry(shape=(2**40, 2**40))), shape, "above the limit"),
        "overflowing strides": (manifest(entry(shape=(0, 2**40, 2**40))), shape, "above the limit"),
        "FULL missing": (manifest(entry(), kind=FULL), "manifest.tensors", "missing"),
        "no kind": (manifest(entry(), kind=0), "manifest.header.kind", "must be"),
    }
    for label, (bad, field, words) in cases.items():
        with pytest.raises(grpc.RpcError) as refused:
            raw_update(client, bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, label
        [violation] = field_violations(refused.value)
        assert violation.field == field and words in violation.description, (label, violation)
    with pytest.raises(grpc.RpcError) as stale:
        raw_update(client, manifest(entry(), version=before.policy_version))
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # Through the group: refused alike, and nothing left half-done, so the next update goes through.
    outcomes = group.update({name: tensor.to(torch.float16)}, version, "subset")
    assert outcomes[0].error.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = client.server_info()
    assert (after.policy_version, after.weights_checksum) == (before.policy_version, before.weights_checksum)
    changed = {name: tensor + 1}
    group.update_weights(changed, version, "subset")
    assert client.server_info().policy_version == version
    group.close()


def test_init_refuses_hostile_options_and_survives_a_dead_store(clients):
    client = clients[1]
    good = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 1}
    good.update(group_name="g", timeout_seconds=2)
    cases = {
        "master_address": {"master_address": "$(reboot)"},
        "master_port": {"master_port": 70000},
        "world_size": {"world_size": 1},
        "rank_offset": {"rank_offset": 0},
        "group_name": {"group_name": "../../etc"},
        "backend": {"backend": "mpi"},
        "timeout_seconds": {"timeout_seconds": float("nan")},
    }
    for field, change in cases.items():
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.InitWeightSync(rollout_pb2.InitWeightSyncRequest(**{**good, **change}), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(refused.value)] == [field]
    # Nothing listens at the store's address: UNAVAILABLE within the timeout, and still serving.
    begin = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        client.stub.InitWeightSync(rollout_pb2.InitWeightSyncRequest(**good), timeout=60)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - begin < 30
    assert health_status(client.channel) == 1 and not client.server_info().HasField("weight_sync")
    with pytest.raises(grpc.RpcError) as none:
        raw_update(client, rollout_pb2.GroupUpdateManifest())
    assert none.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_store_that_never_answers_holds_no_rollout_and_the_join_ends_at_its_timeout(clients):
    """The trainer's address accepts the connection and never answers (a stopped trainer, a port of
    some other service). Both ranks of the SP=2 server connect to it; while they wait, rollouts run;
    the server answers UNAVAILABLE once ``timeout_seconds`` passed (the store is still silent: nothing
    ended the wait but the server's own deadline), in no group, and joins a real group after."""
    client = clients[0]
    timeout = 6  # the join's; a rollout here takes a small fraction of it
    with socket.create_server(("127.0.0.1", 0)) as silent:
        request = rollout_pb2.InitWeightSyncRequest(
            master_address="127.0.0.1",
            master_port=silent.getsockname()[1],
            world_size=3,
            rank_offset=1,
            group_name="silent",
            timeout_seconds=timeout,
        )
        joining = client.stub.InitWeightSync.future(request, timeout=10 * timeout)
        connection, _ = silent.accept()  # a rank's store client connected: the join has begun
        with connection, RolloutClient(client.address, timeout=5 * timeout) as rolling:
            assert len(rolling.rollout(**REQUEST)) == 2
            assert not joining.done()  # the rollout ran while the join waited
            with pytest.raises(grpc.RpcError) as failed:
                joining.result()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"did not finish within {timeout} s (timeout_seconds)" in failed.value.details()
    assert health_status(client.channel) == 1 and not client.server_info().HasField("weight_sync")
    with client.init_weight_sync(timeout=60) as group:
        assert client.server_info().weight_sync.group_id == group.group_ids[0]


def test_an_update_for_a_replaced_group_is_refused_at_once_and_the_live_group_goes_on(clients, base):
    """A second trainer's group replaces the first on the server; the first trainer's next update
    names its own group, so it is refused before anything waits or moves (with the old, unbound
    manifests it was received on the new group, which the server then left at the timeout)."""
    client = clients[1]
    version = client.server_info().policy_version + 1
    name, tensor = next(iter(base.state_dict().items()))
    old, live = WeightSyncGroup([client], timeout=60), WeightSyncGroup([client], timeout=60)
    assert old.joined() == [False] and live.joined() == [True]
    [outcome] = old.update({name: tensor + 1}, version, "subset")
    assert outcome.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "names a group this server is no longer in" in outcome.error.details()
    assert client.server_info().weight_sync.group_id == live.group_ids[0]
    [applied] = live.update_weights({name: tensor + 2}, version, "subset")
    assert applied.policy_version == version == client.server_info().policy_version
    live.close()


def test_a_server_that_refuses_to_join_fails_the_group_at_once(clients):
    """A group name the server refuses: the trainer hears it from the server at once, instead of
    waiting out its own rendezvous; the server is in no group."""
    begin = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        WeightSyncGroup([clients[1]], timeout=60, group_name="bad/name")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(refused.value)] == ["group_name"]
    assert time.monotonic() - begin < 20
    assert not clients[1].server_info().HasField("weight_sync")


# A trainer that dies or stalls mid-broadcast ------------------------------------------------------------

TRAINER = """
import os, sys, time
import torch
from diffusers import AutoModel
from rollout_client import RolloutClient, WeightSyncGroup

address, folder, version, fault = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
client = RolloutClient(address, timeout=120)
group = WeightSyncGroup([client], timeout=float(sys.argv[5]), bucket_bytes=16 * 1024)
model = AutoModel.from_pretrained(folder, subfolder="transformer")
weights = {name: tensor + 1 for name, tensor in model.state_dict().items()}


class Faulty:  # the group's process group, whose fourth broadcast fails: the process dies, or hangs

    def __init__(self, group):
        self.group, self.sent = group, 0

    def broadcast(self, tensors, options):
        if self.sent == 3:
            print("fault", flush=True)
            if fault == "kill":
                os._exit(9)
            time.sleep(3600)
        self.sent += 1
        return self.group.broadcast(tensors, options)


group._group = Faulty(group._group)
group.update_weights(weights, version)
"""


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_a_trainer_lost_mid_broadcast_leaves_the_old_weights_serving(clients, base, tiny_flux_folder, fault):
    client = clients[0]  # the SP=2 server: both ranks must drop the update alike
    before = client.server_info()
    version = before.policy_version + 1
    timeout = "60" if fault == "kill" else "4"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, client.address, str(tiny_flux_folder), str(version), fault, timeout],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout.readline() == "fault\n"
        if fault == "kill":
            assert trainer.wait(timeout=60) == 9
        deadline = time.monotonic() + 60
        while client.server_info().HasField("weight_sync"):  # the server drops the group after it
            assert time.monotonic() < deadline, "the server still holds the group"
            time.sleep(0.2)
    finally:
        trainer.kill()
        trainer.wait()
    after = client.server_info()
    assert (after.policy_version, after.weights_checksum) == (version - 1, before.weights_checksum)
    assert health_status(client.channel) == 1
    assert len(client.rollout(**REQUEST)) == 2
    # A new group and update go through.
    trained = perturbed(base, seed=21)
    with client.init_weight_sync(timeout=60) as group:
        [applied] = group.update_weights(trained.state_dict(), version)
    assert list(applied.rank_checksums) == [served(trained)] * 2
    assert_serves([client], version, served(trained))


def test_a_dead_server_gives_the_trainer_an_error_not_a_hang(cache_dir, tmp_path):
    server = start_server(cache_dir, tmp_path / "doomed.log", "--model", "tiny-flux")
    client = RolloutClient(server.address, timeout=30)
    group = WeightSyncGroup([client], timeout=10)
    server.stop(sig=9)
    begin = time.monotonic()
    [outcome] = group.update({"x": torch.zeros(1)}, 1, "subset")
    assert outcome.error.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - begin < 10
    client.close()


def test_a_lora_wrapped_model_has_its_base_checksum(base):
    """A trainer whose transformer carries a PEFT adapter computes its base's checksum under the
    plain names (``x.base_layer.weight`` is ``x.weight``), as the server does."""
    adapted, _ = with_lora(base, trained=False)
    assert served(adapted) == served(copy.deepcopy(base))
