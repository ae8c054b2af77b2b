"""On-policy weight sync: UpdateWeights / LoadWeights on real servers.

A full update gives the rollouts of a fresh server started on the same weights; a LoRA adapter
changes rollouts exactly as the trainer's adapted copy replays them, and a zero-initialised one
changes nothing; an update waits for the running rollout; every bad update is refused with the right
status and leaves the server as it was; min_policy_version waits for its version or times out.

The policy shows in the latents: a streamed log-prob scores the server's own sample, whose residual
is sd * eps, so it depends on the noise alone. The weights a trainer holds show in replay parity.
"""

import shutil
import threading
import time

import grpc
import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load, save, save_file
from support.families import SERVED_FEATURES
from support.parity import assert_replays
from support.requests import Rollout, make_request, split_events, stream_events
from support.servers import start_server
from support.weights import (
    LORA_TARGETS,
    TO_Q,
    assert_unchanged,
    fingerprint,
    next_version,
    perturbed,
    push_update,
    with_lora,
)

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client import RolloutClient
from rollout_client.client import update_frame
from rollout_client.events import decode_stream
from rollout_core import codec
from rollout_server.weights.upload import TensorAssembler, parse_update_message

EPS = rollout_pb2.DEBUG_TENSOR_EPS
REQUEST = {
    "prompts": ["a red fox in the snow", "two cats"],
    "samples_per_prompt": 1,
    "base_seed": 5,
    "height": 64,
    "width": 64,
    "num_steps": 3,
    "debug_tensors": [EPS],
    "images": False,
}


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights-root")


@pytest.fixture(scope="module")
def updated_server(tiny_flux_folder, cache_dir, weights_root, tmp_path_factory):
    """A tiny-flux server these tests push weights to (each test sets the weights it needs)."""
    server = start_server(
        cache_dir, tmp_path_factory.mktemp("logs") / "updated.log", "--weights-root", str(weights_root)
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def updated(updated_server):
    with RolloutClient(updated_server.address, timeout=120) as rollout_client:
        yield rollout_client


def rollout_events(client: RolloutClient, **fields) -> Rollout:
    return stream_events(client, REQUEST, fields)


def final_latents(rollout: Rollout) -> torch.Tensor:
    return rollout.steps[-1].x_next


def assert_same_rollout(a: Rollout, b: Rollout, latent_atol: float = 1e-6) -> None:
    """Bitwise equal noise and log-probs, latents within ``latent_atol``."""
    assert torch.equal(a.started.x0, b.started.x0)
    for one, two in zip(a.steps, b.steps, strict=True):
        assert torch.equal(one.debug["eps"], two.debug["eps"])
        assert torch.equal(one.log_probs, two.log_probs)
        torch.testing.assert_close(one.x_next, two.x_next, atol=latent_atol, rtol=0)


def restore_base(client: RolloutClient, tiny_transformer) -> int:
    """Push the original weights (a FULL update also drops any adapter); returns the version."""
    version = next_version(client)
    client.update_weights(tiny_transformer.state_dict(), version)
    return version


@pytest.mark.parametrize("piece_bytes", [1, 13, 4096])
def test_update_pieces_form_the_safetensors_buffer(piece_bytes):
    """The client streams a buffer safetensors itself reads back, and the server rebuilds its tensors
    from the pieces as they come."""
    tensors = {
        "weight": torch.randn(5, 3),
        "transposed": torch.randn(4, 6).t(),
        "bf16": torch.randn(7).bfloat16(),
        "steps": torch.arange(3),
        "scalar": torch.tensor(0.5),
        "empty": torch.zeros(0, 2),
    }
    tensors["alias"] = tensors["weight"]
    total_bytes, pieces = codec.encode_in_pieces(tensors, piece_bytes)
    pieces = list(pieces)
    assert all(len(piece) == piece_bytes for piece in pieces[:-1]) and 0 < len(pieces[-1]) <= piece_bytes
    buffer = b"".join(pieces)
    assert len(buffer) == total_bytes
    assembler = TensorAssembler(total_bytes, max_header_bytes=total_bytes, on_tensor=lambda name, t: None)
    for piece in pieces:
        assembler.feed(piece)
    # safetensors' own layout (a trainer may send a saved file's bytes) orders the data differently
    # from its header.
    saved = save({name: t.contiguous().clone() for name, t in tensors.items()})
    from_saved = TensorAssembler(len(saved), max_header_bytes=len(saved), on_tensor=lambda name, t: None)
    from_saved.feed(saved)
    for decoded in (load(buffer), assembler.result(), from_saved.result()):
        assert decoded.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor), name


@pytest.mark.parametrize("size", [1, 127, 128, 16383, 16384, 1024 * 1024])
def test_hand_framed_update_messages_are_the_protobuf_ones(size):
    """The client frames update pieces itself; the bytes are what protobuf serialises, and what the
    server's own parser reads back (the data as a view, without a copy)."""
    piece = bytes(range(256)) * (size // 256) + bytes(size % 256)
    header = rollout_pb2.WeightsUpdateHeader(
        policy_version=3, kind=rollout_pb2.WEIGHTS_KIND_FULL, total_bytes=9
    )
    first = rollout_pb2.UpdateWeightsRequest(header=header, data=piece).SerializeToString()
    later = rollout_pb2.UpdateWeightsRequest(data=piece).SerializeToString()
    assert update_frame(header, 0, size) + piece == first
    assert update_frame(header, 1, size) + piece == later
    for raw, expected_header in ((first, header), (later, None)):
        parsed = parse_update_message(raw)
        assert parsed.header == expected_header and parsed.data == piece
    assert parse_update_message(b"\xff\xff") is None


def test_full_update_matches_a_fresh_server_and_replays(
    updated, tiny_transformer, tiny_flux_folder, weights_root, cache_dir, tmp_path
):
    trained = perturbed(tiny_transformer, seed=1)
    version = next_version(updated)
    response = updated.update_weights(trained.state_dict(), version)
    assert (response.policy_version, response.tensors) == (version, len(trained.state_dict()))
    assert updated.server_info().policy_version == version
    pushed = rollout_events(updated)
    assert pushed.started.message.policy_version == version
    assert_replays(trained, pushed.trajectories())

    # A fresh server on a copy of the pipeline whose transformer/ holds the same weights.
    pipeline = weights_root / "trained-pipeline"
    shutil.copytree(tiny_flux_folder, pipeline)
    shutil.rmtree(pipeline / "transformer")
    trained.save_pretrained(pipeline / "transformer")
    fresh = start_server(cache_dir, tmp_path / "fresh.log", "--model", str(pipeline))
    try:
        with RolloutClient(fresh.address, timeout=120) as fresh_client:
            reference = rollout_events(fresh_client)
    finally:
        fresh.stop()
    assert_same_rollout(pushed, reference)

    # The same weights again, loaded by the server from that pipeline folder under its root.
    restore_base(updated, tiny_transformer)
    loaded = updated.load_weights("trained-pipeline", version + 2)
    assert (loaded.policy_version, loaded.tensors) == (version + 2, len(trained.state_dict()))
    from_disk = rollout_events(updated)
    assert from_disk.started.message.policy_version == version + 2
    assert_same_rollout(from_disk, reference)


def test_the_default_lora_targets_the_server_lists_each_bind_modules_of_its_transformer(
    updated, tiny_transformer
):
    """GetServerInfo's lora_targets (the trainer's default) name modules of the served transformer: an
    adapter on them is taken, and binds the modules PEFT wraps for them, at least one a target."""
    restore_base(updated, tiny_transformer)
    targets = list(updated.server_info().lora_targets)
    assert targets, "the server lists its default targets"
    adapted, config = with_lora(tiny_transformer, trained=False, targets=targets)
    updated.update_weights(get_peft_model_state_dict(adapted), next_version(updated), lora_config=config)
    modules = list(updated.server_info().lora_adapter.modules)
    wrapped = sorted(name for name, module in adapted.named_modules() if isinstance(module, BaseTunerLayer))
    assert modules == wrapped
    assert all(any(name == t or name.endswith("." + t) for name in modules) for t in targets)


def test_lora_adapter_changes_rollouts_as_the_trainer_replays_them(
    updated, client, tiny_transformer, weights_root
):
    restore_base(updated, tiny_transformer)
    base = rollout_events(client)  # the shared server runs the original weights
    adapted, config = with_lora(tiny_transformer, trained=True)
    version = next_version(updated)
    adapter = get_peft_model_state_dict(adapted)
    updated.update_weights(adapter, version, lora_config=config, adapter_name="style")
    info = updated.server_info().lora_adapter
    assert (info.name, info.rank, info.alpha, info.policy_version) == ("style", 4, 8.0, version)
    assert (list(info.target_modules), info.tensors) == (sorted(LORA_TARGETS), len(adapter))
    # The modules the adapter binds to on the server are the ones it wraps in the trainer's copy.
    wrapped = sorted(name for name, module in adapted.named_modules() if isinstance(module, BaseTunerLayer))
    assert wrapped and list(info.modules) == wrapped and info.tensors == 2 * len(wrapped)

    pushed = rollout_events(updated)
    assert pushed.started.message.policy_version == version
    changed = (final_latents(pushed) - final_latents(base)).abs().max()
    assert changed > 1e-3, "the adapter must change the policy"
    assert_replays(adapted, pushed.trajectories())
    with pytest.raises(AssertionError):
        assert_replays(tiny_transformer, pushed.trajectories())  # the base alone does not replay it

    # The same adapter from a PEFT folder (adapter_config.json + adapter_model.safetensors).
    folder = weights_root / "adapter"
    config.save_pretrained(folder)
    save_file(
        {name: t.detach().contiguous() for name, t in adapter.items()}, folder / "adapter_model.safetensors"
    )
    assert updated.load_weights("adapter", version + 1, adapter_name="from-disk").tensors == len(adapter)
    assert updated.server_info().lora_adapter.name == "from-disk"
    assert list(updated.server_info().lora_adapter.modules) == wrapped
    assert_same_rollout(rollout_events(updated), pushed)

    # A FULL update is the whole policy: it removes the adapter.
    restore_base(updated, tiny_transformer)
    assert not updated.server_info().HasField("lora_adapter")
    assert_same_rollout(rollout_events(updated), base)


def test_zero_initialised_adapter_leaves_rollouts_unchanged(updated, client, tiny_transformer):
    restore_base(updated, tiny_transformer)
    adapted, config = with_lora(tiny_transformer, trained=False)
    version = next_version(updated)
    updated.update_weights(get_peft_model_state_dict(adapted), version, lora_config=config)
    assert updated.server_info().lora_adapter.name == "default"
    with_adapter = rollout_events(updated)
    assert with_adapter.started.message.policy_version == version
    assert_same_rollout(with_adapter, rollout_events(client), latent_atol=0.0)


def test_update_waits_for_the_running_rollout(updated_server, updated, client, tiny_transformer):
    old_version = restore_base(updated, tiny_transformer)
    # Without BDP probing the channel keeps gRPC's 64 KiB flow-control window, so a rollout with a few
    # MB of payload stalls until it is read: it is still running while the update is sent.
    long = {
        "num_steps": 100,
        "debug_tensors": [EPS, rollout_pb2.DEBUG_TENSOR_MEAN, rollout_pb2.DEBUG_TENSOR_VELOCITY],
    }
    with grpc.insecure_channel(updated_server.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = rollout_pb2_grpc.RolloutServiceStub(channel).Rollout(make_request(REQUEST, long), timeout=120)
        stream = decode_stream(call)
        started = next(stream)
        assert started.message.policy_version == old_version

        trained = perturbed(tiny_transformer, seed=2)
        applied = {}
        push = threading.Thread(
            target=lambda: applied.update(
                response=updated.update_weights(trained.state_dict(), old_version + 1)
            )
        )
        push.start()
        time.sleep(1.0)
        assert push.is_alive(), "the update must wait for the rollout that is streaming"
        rest = list(stream)
    push.join(timeout=60)
    assert applied["response"].policy_version == old_version + 1

    reference = rollout_events(client, **long)  # the old weights, from the first step to the last
    assert_same_rollout(split_events([started, *rest]), reference)
    after = rollout_events(updated)
    assert after.started.message.policy_version == old_version + 1
    assert_replays(trained, after.trajectories())


def truncated(client, state_dict, version, root, outside):
    _, buffer = codec.encode(state_dict)
    header = rollout_pb2.WeightsUpdateHeader(
        policy_version=version, kind=rollout_pb2.WEIGHTS_KIND_FULL, total_bytes=len(buffer)
    )
    push_update(client, header, buffer[: len(buffer) // 2], timeout=60)


def escaping_link(client, state_dict, version, root, outside):
    (root / "escape").unlink(missing_ok=True)
    (root / "escape").symlink_to(outside / "transformer", target_is_directory=True)
    client.load_weights("escape", version)


GRPC = grpc.StatusCode
# (id, the bad call (client, original state dict, next version, weights root, a folder outside the
# root), the status, text the details must contain)
BAD_UPDATES = [
    (
        "unknown-tensor",
        lambda c, sd, v, root, out: c.update_weights({"nope.weight": torch.zeros(2)}, v, kind="subset"),
        GRPC.INVALID_ARGUMENT,
        "unknown tensor 'nope.weight'",
    ),
    (
        "wrong-shape",
        lambda c, sd, v, root, out: c.update_weights({TO_Q: torch.zeros(31, 32)}, v, kind="subset"),
        GRPC.INVALID_ARGUMENT,
        f"tensor '{TO_Q}' has shape [31, 32]",
    ),
    (
        "wrong-dtype",
        lambda c, sd, v, root, out: c.update_weights({TO_Q: sd[TO_Q].bfloat16()}, v, kind="subset"),
        GRPC.INVALID_ARGUMENT,
        f"tensor '{TO_Q}' is torch.bfloat16",
    ),
    (
        "missing-tensor",
        lambda c, sd, v, root, out: c.update_weights({k: t for k, t in sd.items() if k != TO_Q}, v),
        GRPC.INVALID_ARGUMENT,
        "1 of the transformer's tensors are missing",
    ),
    ("truncated-stream", truncated, GRPC.INVALID_ARGUMENT, "truncated"),
    (
        "stale-version",
        lambda c, sd, v, root, out: c.update_weights(sd, v - 1),
        GRPC.FAILED_PRECONDITION,
        "is not above the server's current version",
    ),
    (
        "lora-targets-nothing",
        lambda c, sd, v, root, out: c.update_weights(
            {"x.lora_A.weight": torch.zeros(4, 32)},
            v,
            lora_config=LoraConfig(r=4, target_modules=["nothing"]),
        ),
        GRPC.INVALID_ARGUMENT,
        "the adapter does not fit the transformer",
    ),
    (
        "path-with-dotdot",
        lambda c, sd, v, root, out: c.load_weights("../elsewhere", v),
        GRPC.PERMISSION_DENIED,
        "outside",
    ),
    (
        "path-outside",
        lambda c, sd, v, root, out: c.load_weights(str(out), v),
        GRPC.PERMISSION_DENIED,
        "outside",
    ),
    ("symlink-out-of-root", escaping_link, GRPC.PERMISSION_DENIED, "outside"),
    (
        "path-absent",
        lambda c, sd, v, root, out: c.load_weights("absent", v),
        GRPC.NOT_FOUND,
        "does not exist",
    ),
]


@pytest.mark.parametrize(
    ("bad_call", "code", "says"), [case[1:] for case in BAD_UPDATES], ids=[c[0] for c in BAD_UPDATES]
)
def test_bad_update_is_refused_and_changes_nothing(
    updated, tiny_transformer, tiny_flux_folder, weights_root, bad_call, code, says
):
    before = fingerprint(updated)
    with pytest.raises(grpc.RpcError) as raised:
        bad_call(updated, tiny_transformer.state_dict(), before[0] + 1, weights_root, tiny_flux_folder)
    assert raised.value.code() == code, raised.value.details()
    assert says in raised.value.details()
    assert_unchanged(before, updated)


def test_load_weights_is_a_feature_of_a_server_with_a_root(updated, client):
    assert list(updated.server_info().features) == [*SERVED_FEATURES, "load_weights"]
    assert list(client.server_info().features) == SERVED_FEATURES


def test_load_weights_is_disabled_without_a_root(client):
    with pytest.raises(grpc.RpcError) as raised:
        client.load_weights("anything", 1)
    assert raised.value.code() == GRPC.FAILED_PRECONDITION
    assert "--weights-root" in raised.value.details()


def test_min_policy_version_waits_for_the_update(updated, tiny_transformer):
    version = next_version(updated)
    waited: dict = {}
    request = make_request(REQUEST, min_policy_version=version)
    waiting = threading.Thread(target=lambda: waited.update(events=list(updated.stream(request))))
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive(), "the rollout must wait for its policy version"
    updated.update_weights(tiny_transformer.state_dict(), version)
    waiting.join(timeout=60)
    assert waited["events"][0].message.policy_version == version
    assert waited["events"][0].message.resolved.min_policy_version == version


def test_min_policy_version_times_out_cleanly(updated_server, updated):
    with RolloutClient(updated_server.address, timeout=1.0) as impatient:
        request = make_request(REQUEST, min_policy_version=next_version(updated) + 100)
        begin = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            impatient.rollout(request)
        assert raised.value.code() == GRPC.DEADLINE_EXCEEDED
        assert time.monotonic() - begin < 10
    assert rollout_events(updated).started.message.policy_version == updated.server_info().policy_version


def test_every_sequence_parallel_rank_applies_the_update(updated, tiny_transformer, cache_dir, tmp_path):
    """SP = 2 (gloo) after a full update and then a LoRA adapter runs the weights SP = 1 runs; an
    adapter that sequence parallelism cannot split is refused."""
    sp2 = start_server(cache_dir, tmp_path / "sp2.log", "--sp", "2")
    try:
        with RolloutClient(sp2.address, timeout=120) as sp2_client:
            trained = perturbed(tiny_transformer, seed=3)
            adapted, config = with_lora(trained, trained=True)
            adapter = get_peft_model_state_dict(adapted)
            for client in (updated, sp2_client):
                client.update_weights(trained.state_dict(), next_version(client))
            one, two = rollout_events(updated), rollout_events(sp2_client)
            assert_same_rollout(one, two, latent_atol=1e-5)
            for client in (updated, sp2_client):
                client.update_weights(adapter, next_version(client), lora_config=config)
            one, two = rollout_events(updated), rollout_events(sp2_client)
            assert_same_rollout(one, two, latent_atol=1e-5)
            assert_replays(adapted, two.trajectories())
            # The top-level proj_out gathers the split sequence: an adapter around it cannot be split.
            with pytest.raises(grpc.RpcError) as raised:
                sp2_client.update_weights(
                    adapter,
                    next_version(sp2_client),
                    lora_config=LoraConfig(r=4, target_modules=["proj_out"]),
                )
            assert raised.value.code() == GRPC.INVALID_ARGUMENT and "proj_out" in raised.value.details()
    finally:
        assert sp2.stop() == 0
