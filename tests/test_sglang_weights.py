"""SGLang-Diffusion's tensor weight endpoints over HTTP, on a tiny-flux server these tests push to:
``/update_weights_from_tensor`` with tensors as data (safetensors bytes, SGLang's flattened bucket)
and ``/update_weights_from_tensor_checker``.

A push over HTTP serves what the same gRPC UpdateWeights serves: the same checksums, and rollouts
bitwise equal (the same server on the same weight bytes runs the same kernels on the same shapes in
the same order: Same path in docs/testing.md). SGLang's own code, taken from its released wheel, lays
out the flattened buckets and computes the SHA-256 the checker compares. A pickle, and every hostile
body, is a 4xx naming its field, and changes nothing.
"""

import ast
import base64
import dataclasses
import hashlib
import io
import math
import re
import socket
import sys
import types
from multiprocessing.reduction import ForkingPickler

import httpx
import msgpack
import pytest
import torch
from peft import get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save
from support.requests import stream_events
from support.servers import http_url, start_server
from support.sglang import sglang_source
from support.weights import (
    FINGERPRINT_REQUEST,
    assert_unchanged,
    fingerprint,
    next_version,
    perturbed,
    with_lora,
)
from torch.distributed.tensor import DTensor

from rollout_client import RolloutClient
from rollout_core import checksum

_POST_TRAINING = "sglang/multimodal_gen/runtime/post_training"
BUCKET_MODULE = "sglang/srt/weight_sync/tensor_bucket.py"
CHECKER_MODULE = f"{_POST_TRAINING}/tensor_update_checker.py"
PUSH, CHECK = "/update_weights_from_tensor", "/update_weights_from_tensor_checker"
MSGPACK = {"content-type": "application/msgpack"}


@pytest.fixture(scope="session")
def sglang_code(cache_dir):
    """SGLang's FlattenedTensorBucket (its module loaded whole: it imports torch alone) and the
    checker's compute_tensor_sha256 (taken out of its module, whose other imports need the package)."""
    bucket = types.ModuleType("sglang_tensor_bucket")
    sys.modules[bucket.__name__] = bucket  # for its dataclasses
    exec(compile(sglang_source(cache_dir, BUCKET_MODULE), BUCKET_MODULE, "exec"), bucket.__dict__)
    tree = ast.parse(sglang_source(cache_dir, CHECKER_MODULE))
    wanted = ("_materialize_local_tensor", "compute_tensor_sha256")
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    checker = {"torch": torch, "hashlib": hashlib, "DTensor": DTensor}
    exec(compile(ast.Module(body=functions, type_ignores=[]), CHECKER_MODULE, "exec"), checker)
    return types.SimpleNamespace(
        FlattenedTensorBucket=bucket.FlattenedTensorBucket, sha256=checker["compute_tensor_sha256"]
    )


@pytest.fixture(scope="module")
def pushed(cache_dir, tiny_flux_folder, tmp_path_factory):
    server = start_server(
        cache_dir, tmp_path_factory.mktemp("logs") / "sglang-weights.log", "--http-port", "0"
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def pusher(pushed):
    with RolloutClient(pushed.address, timeout=120) as client:
        yield client


def post(server, path: str, body: dict, packed: bool = False) -> httpx.Response:
    if packed:
        content = msgpack.packb(body, use_bin_type=True)
        return httpx.post(f"{http_url(server)}{path}", content=content, headers=MSGPACK, timeout=120)
    return httpx.post(f"{http_url(server)}{path}", json=body, timeout=120)


def as_base64(tensors: dict[str, torch.Tensor]) -> str:
    """Tensors as safetensors bytes, in base64 text (JSON's form of bytes)."""
    return base64.b64encode(save({name: t.detach().contiguous() for name, t in tensors.items()})).decode()


def bucket_as_data(bucket) -> dict:
    """An SGLang FlattenedTensorBucket as data: its bytes, and its metadata's fields."""
    metadata = [
        {**dataclasses.asdict(meta), "shape": list(meta.shape), "dtype": str(meta.dtype)}
        for meta in bucket.get_metadata()
    ]
    return {"flattened_tensor": bucket.get_flattened_tensor().numpy().tobytes(), "metadata": metadata}


def rollout_numbers(client: RolloutClient) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's latents and log-probs of a small stochastic rollout."""
    return [(step.x_next, step.log_probs) for step in stream_events(client, FINGERPRINT_REQUEST).steps]


def assert_bitwise_equal(a, b) -> None:
    for (x_a, log_a), (x_b, log_b) in zip(a, b, strict=True):
        assert torch.equal(x_a, x_b) and torch.equal(log_a, log_b)


def restore_base(client: RolloutClient, transformer: torch.nn.Module) -> None:
    """The original weights pushed over gRPC (a FULL update: any adapter goes too)."""
    client.update_weights(transformer.state_dict(), next_version(client))


def test_a_tensor_push_serves_what_the_same_grpc_update_serves(pushed, pusher, tiny_transformer, sglang_code):
    """The trainer's perturbed weights, pushed over gRPC, then (from the base weights again) as one
    safetensors body in JSON, then as two SGLang flattened buckets in msgpack (SUBSET updates, the way
    SGLang's trainers push in parts): each time the same checksums (the update's answer, GetServerInfo,
    /get_weights_checksum) and bitwise the same rollout."""
    trained = perturbed(tiny_transformer, seed=3).state_dict()
    restore_base(pusher, tiny_transformer)
    by_grpc = pusher.update_weights(trained, next_version(pusher))
    grpc_rollout = rollout_numbers(pusher)
    grpc_checksums = post(pushed, "/get_weights_checksum", {}).json()
    assert by_grpc.weights_checksum == pusher.server_info().weights_checksum

    restore_base(pusher, tiny_transformer)
    version = next_version(pusher)
    answer = post(
        pushed, PUSH, {"serialized_named_tensors": [as_base64(trained)], "weight_update_mode": "full"}
    )
    assert answer.status_code == 200, answer.text
    applied = answer.json()
    assert applied["success"] is True and (applied["policy_version"], applied["tensors"]) == (
        version,
        len(trained),
    )
    assert applied["weights_checksum"] == by_grpc.weights_checksum
    info = pusher.server_info()
    assert (info.weights_checksum, info.policy_version) == (by_grpc.weights_checksum, version)
    assert post(pushed, "/get_weights_checksum", {}).json() == grpc_checksums
    assert_bitwise_equal(rollout_numbers(pusher), grpc_rollout)

    restore_base(pusher, tiny_transformer)
    names = list(trained)
    for part in (names[::2], names[1::2]):
        bucket = sglang_code.FlattenedTensorBucket(named_tensors=[(name, trained[name]) for name in part])
        body = {
            "serialized_named_tensors": [{"transformer": bucket_as_data(bucket)}],
            "load_format": "flattened_bucket",
            "target_modules": ["transformer"],
            "weight_version": "7",  # as miles sends it: read, not used
        }
        answer = post(pushed, PUSH, body, packed=True)
        assert answer.status_code == 200, answer.text
        assert answer.json()["tensors"] == len(part)
        assert answer.headers["x-rollout-ignored-fields"] == "weight_version"
    assert pusher.server_info().weights_checksum == by_grpc.weights_checksum
    assert_bitwise_equal(rollout_numbers(pusher), grpc_rollout)
    assert "weight update over HTTP ignored weight_version" in pushed.log()


def test_a_lora_push_in_sglangs_fields_serves_the_adapter_grpc_serves(
    pushed, pusher, tiny_transformer, sglang_code
):
    """A trained adapter (rank 4, alpha 8 on to_q, to_k, to_v, to_out.0), pushed over gRPC with its
    LoraConfig, then over HTTP as SGLang's lora_merge names it (the trainer's state_dict names, rank and
    alpha as fields): the same adapter (its modules, rank, alpha), checksum and rollout bitwise; the
    checker then finds every base and adapter tensor with the SHA-256 SGLang computes."""
    adapted, config = with_lora(tiny_transformer, trained=True)
    adapter = get_peft_model_state_dict(adapted)
    restore_base(pusher, tiny_transformer)
    by_grpc = pusher.update_weights(adapter, next_version(pusher), lora_config=config)
    grpc_adapter = pusher.server_info().lora_adapter
    grpc_rollout = rollout_numbers(pusher)

    restore_base(pusher, tiny_transformer)
    # "transformer_blocks.0.attn.to_q.lora_A.default.weight": PEFT's state_dict names.
    sent = {name: tensor for name, tensor in adapted.state_dict().items() if ".lora_" in name}
    assert sent.keys() != adapter.keys() and len(sent) == len(adapter)
    body = {
        "serialized_named_tensors": [as_base64(sent)],
        "target_modules": ["transformer"],
        "weight_update_mode": "lora_merge",
        "lora_rank": 4,
        "lora_alpha": 8,
    }
    answer = post(pushed, PUSH, body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["weights_checksum"] == by_grpc.weights_checksum
    served = pusher.server_info().lora_adapter
    assert served.policy_version == answer.json()["policy_version"]
    served.policy_version = grpc_adapter.policy_version
    assert served == grpc_adapter  # its name, rank, alpha, target_modules, modules and tensor count
    assert_bitwise_equal(rollout_numbers(pusher), grpc_rollout)

    expected = {
        name: sglang_code.sha256(t) for name, t in {**tiny_transformer.state_dict(), **adapter}.items()
    }
    answer = post(pushed, CHECK, {"target_module": "transformer", "expected_named_tensors_sha256": expected})
    assert answer.status_code == 200, answer.text
    assert answer.json()["success"] is True and set(answer.json()["tensors"].values()) == {"match"}
    restore_base(pusher, tiny_transformer)


def test_a_lora_push_on_some_modules_wraps_those_alone(pushed, pusher, tiny_transformer):
    """An adapter on one block's to_q and on every to_k, as a PeftModel's state_dict names it
    (``base_model.model.`` first): the server wraps exactly the modules the trainer's copy wraps, and
    names them as briefly as selects them alone."""
    adapted, _ = with_lora(tiny_transformer, trained=True, targets=["transformer_blocks.0.attn.to_q", "to_k"])
    wrapped = sorted(name for name, module in adapted.named_modules() if isinstance(module, BaseTunerLayer))
    sent = {f"base_model.model.{name}": t for name, t in adapted.state_dict().items() if ".lora_" in name}
    body = {"serialized_named_tensors": [as_base64(sent)], "weight_update_mode": "lora_merge"}
    answer = post(pushed, PUSH, body)
    assert answer.status_code == 200, answer.text
    served = pusher.server_info().lora_adapter
    assert list(served.modules) == wrapped and served.tensors == 2 * len(wrapped)
    assert list(served.target_modules) == ["to_k", "transformer_blocks.0.attn.to_q"]
    assert (served.rank, served.alpha) == (4, 4.0)  # alpha: the rank, SGLang's default
    restore_base(pusher, tiny_transformer)


def test_the_checker_reports_each_tensor(pushed, pusher, tiny_transformer, sglang_code):
    """SHA-256 as SGLang computes it, against the served tensors: a tensor as served matches, one
    expected with other values mismatches, a name the module does not serve is missing; the answer is
    SGLang's (success, message; 400 unless all match) with the verdict per tensor and the version."""
    restore_base(pusher, tiny_transformer)
    served = tiny_transformer.state_dict()
    names = sorted(served)[:3]
    other = perturbed(tiny_transformer, seed=5).state_dict()[names[1]]
    expected = {
        names[0]: sglang_code.sha256(served[names[0]]),
        names[1]: sglang_code.sha256(other),
        names[2]: sglang_code.sha256(served[names[2]]).upper(),  # hex digits in either case
        "not_a_tensor.weight": sglang_code.sha256(served[names[0]]),
    }
    answer = post(pushed, CHECK, {"target_module": "transformer", "expected_named_tensors_sha256": expected})
    assert answer.status_code == 400, answer.text
    checked = answer.json()
    assert checked["success"] is False and checked["policy_version"] == pusher.server_info().policy_version
    assert checked["tensors"] == {
        names[0]: "match",
        names[1]: "mismatch",
        names[2]: "match",
        "not_a_tensor.weight": "missing",
    }
    assert "1 mismatch" in checked["message"] and "1 missing" in checked["message"]
    matching = {name: expected[name] for name in (names[0], names[2])}
    answer = post(pushed, CHECK, {"target_module": "transformer", "expected_named_tensors_sha256": matching})
    assert answer.status_code == 200 and answer.json()["success"] is True


def test_tensor_sha256_is_sglangs(sglang_code):
    """rollout_core's per-tensor SHA-256, which trainers compute the checker's expected values with, is
    SGLang's own, bit for bit, on every layout a state dict holds."""
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 4, generator=generator),
        torch.randn(5, generator=generator).bfloat16(),
        torch.randn(4, 6, generator=generator).t(),  # not contiguous
        torch.arange(7),
        torch.zeros(0, 2),
    ]
    for tensor in tensors:
        assert checksum.tensor_sha256(tensor) == sglang_code.sha256(tensor)


CHECKER_BODIES = [
    ({"expected_named_tensors_sha256": {"a": "0" * 64}}, "target_module"),
    ({"target_module": "vae", "expected_named_tensors_sha256": {"a": "0" * 64}}, "target_module"),
    ({"target_module": "transformer"}, "expected_named_tensors_sha256"),
    ({"target_module": "transformer", "expected_named_tensors_sha256": {}}, "expected_named_tensors_sha256"),
    (
        {"target_module": "transformer", "expected_named_tensors_sha256": {"a": "0" * 63}},
        "expected_named_tensors_sha256",
    ),
    (
        {"target_module": "transformer", "expected_named_tensors_sha256": {"a": "g" * 64}},
        "expected_named_tensors_sha256",
    ),
    (
        {"target_module": "transformer", "expected_named_tensors_sha256": ["a"]},
        "expected_named_tensors_sha256",
    ),
]


@pytest.mark.parametrize(("body", "field"), CHECKER_BODIES, ids=[str(i) for i in range(len(CHECKER_BODIES))])
def test_a_bad_checker_body_is_a_400_naming_its_field(pushed, body, field):
    answer = post(pushed, CHECK, body)
    assert answer.status_code == 400, answer.text
    assert [violation["field"] for violation in answer.json()["violations"]] == [field]


class _Opens:
    """Unpickled, it would create the file: proof that nothing was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_pickle_is_refused_and_nothing_changes(pushed, pusher, tmp_path):
    """SGLang's payloads are MultiprocessingSerializer pickles (ForkingPickler, in base64): one that
    would create a file when loaded, sent as SGLang sends its tensors and its flattened buckets, is a
    400 whose message names the formats taken; no file appears, and the policy is as it was."""
    before = fingerprint(pusher)
    opened = tmp_path / "unpickled"
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("weight", _Opens(opened))])
    pickled = base64.b64encode(buffer.getvalue()).decode()
    for load_format in (None, "flattened_bucket"):
        answer = post(pushed, PUSH, {"serialized_named_tensors": [pickled], "load_format": load_format})
        assert answer.status_code == 400, answer.text
        refused = answer.json()
        assert refused["success"] is False and refused["violations"][0]["field"] == "serialized_named_tensors"
        assert "pickle" in refused["message"] and "never unpickles" in refused["message"]
        assert "safetensors bytes" in refused["message"] and "flattened_bucket" in refused["message"]
    assert not opened.exists()
    assert_unchanged(before, pusher)


def hostile_bodies(tensors: dict[str, torch.Tensor], name: str, max_update_bytes: int) -> list:
    """(id, body, msgpack or not, the field its 400 names), from the served ``tensors``."""
    tensor = tensors[name]
    good = save({name: tensor.contiguous()})
    nan = tensor.clone()
    nan.view(-1)[0] = float("nan")
    entry = [base64.b64encode(good).decode()]
    return [
        ("truncated", {"serialized_named_tensors": [good[:-3]]}, True, "serialized_named_tensors"),
        (
            "wrong-shape",
            {"serialized_named_tensors": [as_base64({name: tensor[:1]})]},
            False,
            "serialized_named_tensors",
        ),
        (
            "wrong-dtype",
            {"serialized_named_tensors": [as_base64({name: tensor.double()})]},
            False,
            "serialized_named_tensors",
        ),
        ("nan", {"serialized_named_tensors": [as_base64({name: nan})]}, False, "serialized_named_tensors"),
        (
            "unknown-name",
            {"serialized_named_tensors": [as_base64({"nope": tensor})]},
            False,
            "serialized_named_tensors",
        ),
        (
            "oversized",
            {"serialized_named_tensors": [bytes(max_update_bytes + 1)]},
            True,
            "serialized_named_tensors",
        ),
        ("not-base64", {"serialized_named_tensors": ["not base64!"]}, False, "serialized_named_tensors"),
        ("two-payloads", {"serialized_named_tensors": entry * 2}, False, "serialized_named_tensors"),
        ("no-payload", {}, False, "serialized_named_tensors"),
        ("payload-a-number", {"serialized_named_tensors": [3]}, False, "serialized_named_tensors"),
        (
            "other-module",
            {"serialized_named_tensors": [{"vae": entry[0]}]},
            False,
            "serialized_named_tensors",
        ),
        ("load-format", {"serialized_named_tensors": entry, "load_format": 3}, False, "load_format"),
        (
            "load-format-unknown",
            {"serialized_named_tensors": entry, "load_format": "direct"},
            False,
            "load_format",
        ),
        (
            "targets-a-string",
            {"serialized_named_tensors": entry, "target_modules": "transformer"},
            False,
            "target_modules",
        ),
        (
            "target-unknown",
            {"serialized_named_tensors": entry, "target_modules": ["vae"]},
            False,
            "target_modules",
        ),
        (
            "mode",
            {"serialized_named_tensors": entry, "weight_update_mode": "merge"},
            False,
            "weight_update_mode",
        ),
        (
            "full-but-one-tensor",
            {"serialized_named_tensors": entry, "weight_update_mode": "full"},
            False,
            "serialized_named_tensors",
        ),
        (
            "lora-not-lora",
            {"serialized_named_tensors": entry, "weight_update_mode": "lora_merge"},
            False,
            "serialized_named_tensors",
        ),
        ("lora-rank", {"serialized_named_tensors": entry, "lora_rank": -1}, False, "lora_rank"),
        ("lora-alpha", {"serialized_named_tensors": entry, "lora_alpha": "x"}, False, "lora_alpha"),
        ("version", {"serialized_named_tensors": entry, "policy_version": "2"}, False, "policy_version"),
        (
            "version-huge",
            {"serialized_named_tensors": entry, "policy_version": 2**64},
            False,
            "policy_version",
        ),
        (
            "bucket-dtype",
            {
                "serialized_named_tensors": [
                    {"flattened_tensor": good, "metadata": [{"name": name, "dtype": "torch.nope"}]}
                ],
                "load_format": "flattened_bucket",
            },
            True,
            "serialized_named_tensors.metadata[0].dtype",
        ),
        (
            "bucket-offsets",
            {
                "serialized_named_tensors": [
                    {
                        "flattened_tensor": bytes(tensor.nbytes),
                        "metadata": [
                            {
                                "name": name,
                                "dtype": "float32",
                                "shape": list(tensor.shape),
                                "start_idx": 4,
                                "end_idx": tensor.nbytes + 4,
                                "numel": tensor.nbytes,
                            }
                        ],
                    }
                ],
                "load_format": "flattened_bucket",
            },
            True,
            "serialized_named_tensors.metadata",
        ),
    ]


def test_hostile_bodies_are_400s_naming_their_field_and_change_nothing(pushed, pusher, tiny_transformer):
    """Each body is refused with a 400 naming its field and SGLang's failure answer, in one log line
    without a traceback; the policy version and checksum stay, and a rollout is bitwise as before."""
    restore_base(pusher, tiny_transformer)
    before = fingerprint(pusher)
    info = pusher.server_info()
    tensors = tiny_transformer.state_dict()
    cases = hostile_bodies(tensors, sorted(tensors)[0], info.limits.max_update_bytes)
    for case, body, packed, field in cases:
        answer = post(pushed, PUSH, body, packed)
        assert answer.status_code == 400, (case, answer.text)
        assert [violation["field"] for violation in answer.json()["violations"]] == [field], (
            case,
            answer.text,
        )
        assert answer.json()["success"] is False, case
        after = pusher.server_info()
        assert (after.policy_version, after.weights_checksum) == (info.policy_version, info.weights_checksum)
    assert "Traceback" not in pushed.log()
    assert_unchanged(before, pusher)


def test_a_stale_version_and_an_oversized_body_are_refused_before_their_tensors(pushed, pusher):
    """A version not above the served one is refused (400) before the tensors are decoded; a body longer
    than the bound (an update's bytes in base64, and 64 KiB for the other fields) from its header (413),
    before it is sent."""
    info = pusher.server_info()
    body = {"serialized_named_tensors": ["AAAA"], "policy_version": info.policy_version}
    answer = post(pushed, PUSH, body)
    assert answer.status_code == 400 and "policy version" in answer.json()["message"], answer.text
    limit = 4 * math.ceil(info.limits.max_update_bytes / 3) + 64 * 1024
    host, port = re.match(r"http://(.+):(\d+)", http_url(pushed)).groups()
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(
            f"POST {PUSH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {limit + 1}\r\n\r\n".encode()
        )
        assert connection.recv(65536).startswith(b"HTTP/1.1 413 ")
    assert pusher.server_info().weights_checksum == info.weights_checksum
