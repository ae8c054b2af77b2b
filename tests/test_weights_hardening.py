"""Weight updates a client gets wrong, by accident or on purpose, on a real tiny-flux server.

Each refused update names what is wrong, leaves the weights bitwise as they were, and leaves the
server SERVING (a grpc.health.v1 probe answers) and producing rollouts. A failure while applying an
update that passed every check restores the previous weights (checked in-process on the real tiny
transformer: from outside, nothing that passes the checks fails any more).
"""

import contextlib
import copy
import json
import math
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from peft import get_peft_model_state_dict
from safetensors.torch import save_file
from support.errors import field_violations, health_status
from support.servers import start_server, vm_rss_bytes
from support.weights import (
    TO_Q,
    assert_unchanged,
    fingerprint,
    next_version,
    perturbed,
    push_update,
    with_lora,
)

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient
from rollout_client.updates import lora_config_json
from rollout_server.weights.apply import apply_update
from rollout_server.weights.files import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE
from rollout_server.weights.update import FULL, LORA, WeightUpdate

GRPC = grpc.StatusCode
IDLE_SECONDS = 2
# A regular expression with catastrophic backtracking: PEFT would fullmatch it against every module.
REDOS = "(.+)+X"
TO_Q_LORA = {
    "transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 32),
    "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 2),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hardened-root")


@pytest.fixture(scope="module")
def hardened(cache_dir, tiny_flux_folder, root, tmp_path_factory):
    server = start_server(
        cache_dir,
        tmp_path_factory.mktemp("logs") / "hardened.log",
        "--weights-root",
        str(root),
        "--upload-idle-seconds",
        str(IDLE_SECONDS),
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def pusher(hardened):
    with RolloutClient(hardened.address, timeout=20) as client:
        yield client


def assert_serving(server, client: RolloutClient) -> None:
    """The health probe answers SERVING at once, and a rollout runs."""
    with grpc.insecure_channel(server.address) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    assert fingerprint(client)[0] == client.server_info().policy_version
    assert server.process.poll() is None
    assert "Traceback" not in server.log()


def assert_refused(raised, code: GRPC, field: str | None = None, says: str = "") -> None:
    error = raised.value
    assert error.code() == code, error.details()
    if field is not None:
        violations = [(v.field, v.description) for v in field_violations(error)]
        assert any(f == field and says in d for f, d in violations), violations


def config(**fields) -> dict:
    return {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["to_q"], **fields}


REFUSED_CONFIGS = [
    ("regex-targets", config(target_modules=REDOS), "target_modules"),
    ("no-targets-but-parameters", config(target_modules=[], target_parameters=[TO_Q]), "target_modules"),
    ("target-parameters", config(target_parameters=[TO_Q]), "target_parameters"),
    ("exclude-modules", config(exclude_modules=REDOS), "exclude_modules"),
    ("layers-pattern", config(layers_pattern=REDOS), "layers_pattern"),
    ("layers-to-transform", config(layers_to_transform=[0]), "layers_to_transform"),
    ("rank-pattern", config(rank_pattern={REDOS: 4}), "rank_pattern"),
    ("alpha-pattern", config(alpha_pattern={REDOS: 4}), "alpha_pattern"),
    ("modules-to-save", config(modules_to_save=["proj_out"]), "modules_to_save"),
    ("bias-lora-only", config(bias="lora_only"), "bias"),
    ("bias-all", config(bias="all"), "bias"),
    ("alpha-nan", config(lora_alpha=math.nan), "lora_alpha"),
    ("dropout-inf", config(lora_dropout=math.inf), "lora_dropout"),
    ("rank-zero", config(r=0), "'r'"),
    ("module-with-regex", config(target_modules=["to_.*"]), "target_modules"),
    ("pissa-init", config(init_lora_weights="pissa"), "init_lora_weights"),
]


@pytest.mark.parametrize(
    ("lora_config", "says"), [case[1:] for case in REFUSED_CONFIGS], ids=[case[0] for case in REFUSED_CONFIGS]
)
def test_lora_config_outside_the_allow_list_is_refused(hardened, pusher, lora_config, says):
    """A regex never reaches PEFT (it froze the server), nor do fields that would change base weights
    (bias) or that PEFT fails on while applying (target_parameters)."""
    before = fingerprint(pusher)
    with pytest.raises(grpc.RpcError) as raised:
        pusher.update_weights(TO_Q_LORA, before[0] + 1, lora_config=lora_config)
    assert_refused(raised, GRPC.INVALID_ARGUMENT, "header.lora_config_json", says)
    assert_unchanged(before, pusher)
    assert_serving(hardened, pusher)


def test_a_trainers_lora_config_passes(hardened, pusher, tiny_transformer):
    """The full to_dict() of a LoraConfig, metadata fields included, is accepted."""
    adapted, lora = with_lora(tiny_transformer, trained=True)
    lora = copy.copy(lora)
    lora.revision = "main"
    assert json.loads(lora_config_json(lora))["peft_version"]
    version = next_version(pusher)
    pusher.update_weights(get_peft_model_state_dict(adapted), version, lora_config=lora)
    assert pusher.server_info().lora_adapter.policy_version == version
    assert_serving(hardened, pusher)


def nan_at(tensor: torch.Tensor, value: float = math.nan) -> torch.Tensor:
    tensor = tensor.detach().clone()
    tensor.view(-1)[tensor.numel() // 2] = value
    return tensor


def lora_with_nan(client, state_dict, version, root):
    adapter = {name: nan_at(t) if "lora_B" in name else t for name, t in TO_Q_LORA.items()}
    client.update_weights(adapter, version, lora_config=config())


def full_with_nan(client, state_dict, version, root):
    client.update_weights({**state_dict, TO_Q: nan_at(state_dict[TO_Q])}, version)


def loaded_with_nan(client, state_dict, version, root):
    save_file({TO_Q: nan_at(state_dict[TO_Q])}, root / "nan.safetensors")
    client.load_weights("nan.safetensors", version, kind="subset")


# (id, the update (client, state dict, next version, weights root), the tensor it names)
NON_FINITE = [
    (
        "subset-one-nan",
        lambda c, sd, v, r: c.update_weights({TO_Q: nan_at(sd[TO_Q])}, v, kind="subset"),
        TO_Q,
    ),
    (
        "subset-all-inf",
        lambda c, sd, v, r: c.update_weights({TO_Q: torch.full_like(sd[TO_Q], math.inf)}, v, kind="subset"),
        TO_Q,
    ),
    ("full-one-nan", full_with_nan, TO_Q),
    ("lora-one-nan", lora_with_nan, "transformer_blocks.0.attn.to_q.lora_B.weight"),
    ("load-weights-nan", loaded_with_nan, TO_Q),
]


@pytest.mark.parametrize(
    ("push", "tensor"), [case[1:] for case in NON_FINITE], ids=[case[0] for case in NON_FINITE]
)
def test_non_finite_weights_are_refused(hardened, pusher, tiny_transformer, root, push, tensor):
    before = fingerprint(pusher)
    with pytest.raises(grpc.RpcError) as raised:
        push(pusher, tiny_transformer.state_dict(), before[0] + 1, root)
    assert_refused(raised, GRPC.INVALID_ARGUMENT, "data", f"tensor '{tensor}'")
    assert "NaN or infinite" in raised.value.details()
    assert_unchanged(before, pusher)
    assert_serving(hardened, pusher)


def test_policy_version_above_the_limit_is_refused(hardened, pusher, tiny_transformer, root):
    """2^64 - 1 would leave no room for another update; the next version still works after it."""
    save_file({TO_Q: tiny_transformer.state_dict()[TO_Q].contiguous()}, root / "to_q.safetensors")
    top = 2**64 - 1
    with pytest.raises(grpc.RpcError) as raised:
        pusher.update_weights({TO_Q: tiny_transformer.state_dict()[TO_Q]}, top, kind="subset")
    assert_refused(raised, GRPC.INVALID_ARGUMENT, "header.policy_version", "at most")
    with pytest.raises(grpc.RpcError) as raised:
        pusher.load_weights("to_q.safetensors", top, kind="subset")
    assert_refused(raised, GRPC.INVALID_ARGUMENT, "policy_version", "at most")
    version = next_version(pusher)
    pusher.update_weights({TO_Q: tiny_transformer.state_dict()[TO_Q]}, version, kind="subset")
    assert pusher.server_info().policy_version == version
    assert_serving(hardened, pusher)


def safetensors_buffer(header: dict | bytes, data: bytes = b"", declared_length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if declared_length is None else declared_length) + text + data


def entry(shape: list, offsets: list, dtype: str = "F32") -> dict:
    return {TO_Q: {"dtype": dtype, "shape": shape, "data_offsets": offsets}}


MALFORMED = [
    ("negative-shape", safetensors_buffer(entry([-2, -2], [0, 16]), bytes(16))),
    ("zero-and-negative", safetensors_buffer(entry([0, -1], [0, 0]))),
    ("absurd-dims", safetensors_buffer(entry([2**62, 2**62], [0, 16]), bytes(16))),
    ("offsets-past-the-data", safetensors_buffer(entry([2, 2], [0, 4096]), bytes(16))),
    ("offsets-disagree-with-shape", safetensors_buffer(entry([2, 2], [0, 8]), bytes(16))),
    ("header-length-beyond-buffer", safetensors_buffer(entry([2, 2], [0, 16]), bytes(16), 2**40)),
    ("header-not-json", safetensors_buffer(b"{not json at all", bytes(16))),
    ("header-deeply-nested", safetensors_buffer(b"[" * 50_000)),
    ("unknown-dtype", safetensors_buffer(entry([2, 2], [0, 16], dtype="F128"), bytes(16))),
]


def push_raw(client: RolloutClient, version: int, buffer: bytes) -> None:
    header = rollout_pb2.WeightsUpdateHeader(
        policy_version=version, kind=rollout_pb2.WEIGHTS_KIND_SUBSET, total_bytes=len(buffer)
    )
    push_update(client, header, buffer, timeout=20)


@pytest.mark.parametrize("buffer", [case[1] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_safetensors_buffer_is_invalid_argument(hardened, pusher, buffer):
    before = fingerprint(pusher)
    with pytest.raises(grpc.RpcError) as raised:
        push_raw(pusher, before[0] + 1, buffer)
    assert_refused(raised, GRPC.INVALID_ARGUMENT, "data")
    assert_unchanged(before, pusher)
    assert_serving(hardened, pusher)


def symlink_loop(root) -> str:
    (root / "loop").unlink(missing_ok=True)
    (root / "loop").symlink_to(root / "loop")
    return "loop/transformer"


BAD_PATHS = [
    ("nul-byte", lambda root: "weights\0.safetensors"),
    ("300-character-name", lambda root: "w" * 300),
    ("5000-character-path", lambda root: "/".join(["abcd"] * 1000)),
    ("symlink-loop", symlink_loop),
]


@pytest.mark.parametrize("path", [case[1] for case in BAD_PATHS], ids=[case[0] for case in BAD_PATHS])
def test_unusable_load_path_is_refused_not_internal(hardened, pusher, root, path):
    before = fingerprint(pusher)
    with pytest.raises(grpc.RpcError) as raised:
        pusher.load_weights(path(root), before[0] + 1)
    assert raised.value.code() in (GRPC.INVALID_ARGUMENT, GRPC.NOT_FOUND), raised.value.details()
    if raised.value.code() == GRPC.INVALID_ARGUMENT:
        assert_refused(raised, GRPC.INVALID_ARGUMENT, "path")
    assert_unchanged(before, pusher)
    assert_serving(hardened, pusher)


def test_load_weights_larger_than_an_update_is_refused_unread(hardened, pusher, root):
    """Files on disk count against the same bound as a streamed update: a safetensors file larger
    than limits.max_update_bytes is refused on ``path`` before it is read."""
    max_bytes = pusher.server_info().limits.max_update_bytes
    save_file({"big": torch.zeros(max_bytes // 4 + 1)}, root / "too-big.safetensors")
    before = fingerprint(pusher)
    with pytest.raises(grpc.RpcError) as raised:
        pusher.load_weights("too-big.safetensors", before[0] + 1)
    assert_refused(raised, GRPC.INVALID_ARGUMENT, "path")
    assert f"an update is at most {max_bytes}" in raised.value.details()
    assert_unchanged(before, pusher)
    assert_serving(hardened, pusher)


def fifo_in(folder, name: str) -> str:
    folder.mkdir(exist_ok=True)
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    return folder.name


def release_fifos(folder) -> None:
    """A writer's open releases a reader blocked in opening a FIFO (the server before the check)."""
    for fifo in folder.glob("*"):
        with contextlib.suppress(OSError):  # ENXIO: no reader is waiting
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


# (id, a folder under the root holding a FIFO where a file is read, the kind asked for)
FIFOS = [
    ("weights-file", lambda root: fifo_in(root / "fifo-weights", "model.safetensors"), None),
    ("named-file", lambda root: f"{fifo_in(root / 'fifo-file', 'x.safetensors')}/x.safetensors", "subset"),
    ("adapter-weights", lambda root: fifo_with_adapter_config(root / "fifo-adapter"), "lora"),
]


def fifo_with_adapter_config(folder) -> str:
    fifo_in(folder, PEFT_WEIGHTS_FILE)
    (folder / PEFT_CONFIG_FILE).write_text(json.dumps(config()))
    return folder.name


@pytest.mark.parametrize(("path", "kind"), [case[1:] for case in FIFOS], ids=[case[0] for case in FIFOS])
def test_a_fifo_is_refused_and_health_answers_throughout(hardened, pusher, root, path, kind):
    """A FIFO among the weights is never opened for reading (the open would wait for a writer, holding
    the process): the load is refused on ``path``, and a health probe with a one-second deadline is
    answered SERVING all the while."""
    requested = path(root)
    before = fingerprint(pusher)
    try:
        with ThreadPoolExecutor(1) as pool, grpc.insecure_channel(hardened.address) as channel:
            loading = pool.submit(pusher.load_weights, requested, before[0] + 1, kind)
            probes = []
            while not loading.done() or not probes:
                probes.append(probe_within_a_second(channel))
            assert set(probes) == {health_pb2.HealthCheckResponse.SERVING}, probes
            with pytest.raises(grpc.RpcError) as raised:
                loading.result()
    finally:
        release_fifos(root / requested.split("/")[0])
    assert_refused(raised, GRPC.INVALID_ARGUMENT, "path", "is not a regular file")
    assert_unchanged(before, pusher)
    assert_serving(hardened, pusher)


def probe_within_a_second(channel: grpc.Channel) -> int | grpc.StatusCode:
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
    except grpc.RpcError as error:
        return error.code()


def outside_file(outside, state_dict) -> Path:
    outside.mkdir(exist_ok=True)
    save_file({TO_Q: state_dict[TO_Q].contiguous()}, outside / "to_q.safetensors")
    return outside / "to_q.safetensors"


def linked(root, folder: str, name: str, target: Path) -> str:
    (root / folder).mkdir(exist_ok=True)
    (root / folder / name).unlink(missing_ok=True)
    (root / folder / name).symlink_to(target, target_is_directory=target.is_dir())
    return folder


def pipeline_with_linked_transformer(root, outside: Path) -> str:
    folder = linked(root, "linked-pipeline", "transformer", outside)
    (root / folder / "model_index.json").write_text("{}")
    return folder


def adapter_with_linked_weights(root, outside: Path) -> str:
    save_file(TO_Q_LORA, outside / PEFT_WEIGHTS_FILE)
    folder = linked(root, "linked-adapter", PEFT_WEIGHTS_FILE, outside / PEFT_WEIGHTS_FILE)
    (root / folder / PEFT_CONFIG_FILE).write_text(json.dumps(config()))
    return folder


# (id, the folder under the root whose file or sub-folder links out of it (root, the outside folder),
# the kind asked for)
ESCAPING_LINKS = [
    (
        "weights-file",
        lambda root, out: linked(root, "linked-file", "model.safetensors", out / "to_q.safetensors"),
        "subset",
    ),
    ("pipeline-transformer", pipeline_with_linked_transformer, "subset"),
    ("adapter-weights", adapter_with_linked_weights, "lora"),
]


@pytest.mark.parametrize(
    ("folder", "kind"), [case[1:] for case in ESCAPING_LINKS], ids=[case[0] for case in ESCAPING_LINKS]
)
def test_a_link_inside_a_folder_out_of_the_root_is_refused(
    hardened, pusher, tiny_transformer, root, tmp_path, folder, kind
):
    """Each file read is checked after its links are resolved, not only the folder asked for."""
    outside_file(tmp_path, tiny_transformer.state_dict())
    before = fingerprint(pusher)
    with pytest.raises(grpc.RpcError) as raised:
        pusher.load_weights(folder(root, tmp_path), before[0] + 1, kind)
    assert_refused(raised, GRPC.PERMISSION_DENIED)
    assert "outside the server's --weights-root" in raised.value.details()
    assert_unchanged(before, pusher)
    assert_serving(hardened, pusher)


def test_a_link_that_stays_inside_the_root_is_read(hardened, pusher, tiny_transformer, root):
    """Links within the root (a hub cache's snapshot pointing at its blobs) load as the file would."""
    blob = outside_file(root / "blobs", tiny_transformer.state_dict())
    folder = linked(root, "snapshot", "model.safetensors", blob)
    version = next_version(pusher)
    assert pusher.load_weights(folder, version, kind="subset").policy_version == version
    assert_serving(hardened, pusher)


class HeldUpload:
    """An UpdateWeights call that sends its header and then nothing, until released or cut."""

    def __init__(self, client: RolloutClient, header: rollout_pb2.WeightsUpdateHeader):
        self.release = threading.Event()

        def messages():
            yield rollout_pb2.UpdateWeightsRequest(header=header)
            self.release.wait(timeout=60)

        self.call = client.stub.UpdateWeights.future(messages(), timeout=60)

    def __enter__(self) -> "HeldUpload":
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.call.cancel()


def full_header(version: int, total_bytes: int) -> rollout_pb2.WeightsUpdateHeader:
    return rollout_pb2.WeightsUpdateHeader(
        policy_version=version, kind=rollout_pb2.WEIGHTS_KIND_FULL, total_bytes=total_bytes
    )


def test_one_update_at_a_time(hardened, pusher, tiny_transformer, root):
    """While an upload is open, another UpdateWeights or LoadWeights is refused at once; once the first
    caller cancels, the slot is free again."""
    save_file({TO_Q: tiny_transformer.state_dict()[TO_Q].contiguous()}, root / "to_q.safetensors")
    version = next_version(pusher)
    to_q = {TO_Q: tiny_transformer.state_dict()[TO_Q]}
    with HeldUpload(pusher, full_header(version, 1024)) as held:
        # A stale second update is FAILED_PRECONDITION until the held one holds the slot.
        deadline = time.monotonic() + 10
        while True:
            begin = time.monotonic()
            with pytest.raises(grpc.RpcError) as raised:
                pusher.update_weights(to_q, version - 1, kind="subset")
            if raised.value.code() == GRPC.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                break
        assert_refused(raised, GRPC.RESOURCE_EXHAUSTED)
        assert time.monotonic() - begin < 1.0 and "one at a time" in raised.value.details()
        with pytest.raises(grpc.RpcError) as raised:
            pusher.load_weights("to_q.safetensors", version, kind="subset")
        assert_refused(raised, GRPC.RESOURCE_EXHAUSTED)
        held.call.cancel()
    deadline = time.monotonic() + 10
    while True:
        try:
            pusher.update_weights(to_q, version, kind="subset")
            break
        except grpc.RpcError as error:
            assert error.code() == GRPC.RESOURCE_EXHAUSTED and time.monotonic() < deadline
    assert pusher.server_info().policy_version == version
    assert_serving(hardened, pusher)


def test_idle_upload_is_cut_and_never_allocates_what_it_declares(hardened, pusher):
    """A header declaring the largest update, then silence: DEADLINE_EXCEEDED after the idle timeout,
    the server's memory does not grow meanwhile, and the next update is taken."""
    max_bytes = pusher.server_info().limits.max_update_bytes
    baseline = peak = vm_rss_bytes(hardened.process.pid)
    version = next_version(pusher)
    begin = time.monotonic()
    with HeldUpload(pusher, full_header(version, max_bytes)) as held:
        while not held.call.done():  # sample the server's memory until the server cuts the call
            peak = max(peak, vm_rss_bytes(hardened.process.pid))
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as raised:
            held.call.result()
    assert raised.value.code() == GRPC.DEADLINE_EXCEEDED and "no update message" in raised.value.details()
    assert IDLE_SECONDS <= time.monotonic() - begin < IDLE_SECONDS + 10
    assert peak - baseline < max_bytes // 4, f"RSS grew by {(peak - baseline) / 2**20:.1f} MiB"
    assert_serving(hardened, pusher)


def test_failed_apply_restores_the_previous_weights_and_adapter(tiny_transformer):
    """apply_update on the real tiny transformer, with one tensor that cannot be copied (on the meta
    device) after others were written: every weight, the adapter and the active adapter are as before."""
    transformer = copy.deepcopy(tiny_transformer)
    adapted, lora = with_lora(tiny_transformer, trained=True)
    lora_json = lora_config_json(lora)
    adapter = get_peft_model_state_dict(adapted)
    loaded = apply_update(transformer, WeightUpdate(1, LORA, adapter, 0, lora_json), None)
    before = {name: tensor.clone() for name, tensor in transformer.state_dict().items()}

    def assert_as_before() -> None:
        after = transformer.state_dict()
        assert after.keys() == before.keys()
        assert all(torch.equal(after[name], before[name]) for name in before)
        assert list(transformer.peft_config) == ["policy_v1"]
        assert transformer.active_adapters() == ["policy_v1"]

    trained = perturbed(tiny_transformer, seed=4).state_dict()
    last = list(trained)[-1]
    trained[last] = torch.empty_like(trained[last], device="meta")
    with pytest.raises(NotImplementedError):
        apply_update(transformer, WeightUpdate(2, FULL, trained, 0), loaded)
    assert_as_before()

    broken = dict(adapter)
    broken[list(broken)[-1]] = torch.empty_like(broken[list(broken)[-1]], device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        apply_update(transformer, WeightUpdate(3, LORA, broken, 0, lora_json), loaded)
    assert_as_before()
