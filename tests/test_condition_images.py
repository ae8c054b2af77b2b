"""Conditioning images are hostile input: each bad file is refused with INVALID_ARGUMENT naming
``condition_images[i]``, before any work, and the server stays SERVING; a good one is read, resized
and described in the started event. The prompt cache keys on the image: the same text with another
image is another env, the same text and image a hit that is bitwise what encoding gives."""

import hashlib
import io
import struct
import zlib

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2
from helpers import (
    assert_same_kwargs,
    condition_image,
    condition_png,
    family_request,
    field_violations,
    health_status,
)
from PIL import Image

from rollout.v1 import rollout_pb2
from rollout_client import Trajectory
from rollout_client.images import LABEL_HEIGHT
from rollout_server import families, images
from rollout_server.families.base import MediaShape
from rollout_server.limits import Limits
from rollout_server.prompt_cache import PromptCache

IMAGE_FAMILIES = ["flux-kontext", "qwen-image-edit", "wan-i2v"]
SHAPE = MediaShape(frames=1, height=64, width=64)


def encoded(image: Image.Image, format: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header states ``width`` x ``height`` RGB pixels, with no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def hostile_images() -> dict[str, tuple[bytes, str]]:
    """Bad files, each with a word its refusal must say."""
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    palette = rgb.convert("P")
    palette.info["transparency"] = 0
    frames = [rgb, rgb.rotate(90)]
    return {
        "truncated": (encoded(rgb)[:1500], "truncated"),
        "100000x100000 header": (png_claiming(100_000, 100_000), "pixels"),
        "cmyk": (encoded(rgb.convert("CMYK"), "JPEG"), "CMYK"),
        "16-bit": (encoded(Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16))), "I;16"),
        "palette with transparency": (encoded(palette, transparency=0), "transparency"),
        "animated gif": (encoded(rgb, "GIF", save_all=True, append_images=frames[1:]), "PNG or JPEG"),
        "animated png": (encoded(rgb, "PNG", save_all=True, append_images=frames[1:]), "frames"),
        "zero bytes": (b"", "empty"),
        "not an image": (b"GIF89a? no: a text file\n" * 4, "PNG or JPEG"),
    }


HOSTILE = hostile_images()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_hostile_file_is_refused_with_a_reason(name):
    data, word = HOSTILE[name]
    with pytest.raises(images.BadImage, match=word):
        images.check(data, Limits())


def test_a_good_image_is_converted_resized_and_described():
    gray = encoded(Image.fromarray(np.arange(48 * 32, dtype=np.uint8).reshape(32, 48) % 251, "L"), "JPEG")
    read = images.read(gray, Limits(), 64, 64, "latents")
    assert (read.image.mode, read.image.size) == ("RGB", (64, 64))
    info = read.info
    assert (info.format, info.mode, info.width, info.height) == ("JPEG", "L", 48, 32)
    assert (info.resized_width, info.resized_height, info.resample) == (64, 64, "lanczos")
    assert info.sha256 == hashlib.sha256(gray).hexdigest()
    # Resized as diffusers' image processors resize (PIL Lanczos), and not at all at the right size.
    expected = Image.open(io.BytesIO(gray)).convert("RGB").resize((64, 64), Image.Resampling.LANCZOS)
    assert np.array_equal(np.asarray(read.image), np.asarray(expected))
    same = images.read(condition_png(1), Limits(), 64, 64, "latents")
    assert same.info.resample == "none"
    assert np.array_equal(np.asarray(same.image), np.asarray(Image.open(io.BytesIO(condition_png(1)))))


def test_the_pixel_bound_is_read_from_the_header_before_decoding():
    limits = Limits(max_image_pixels=64 * 63)
    with pytest.raises(images.BadImage, match="64 x 64 pixels, above 4032"):
        images.check(condition_png(0), limits)
    with pytest.raises(images.BadImage, match="bytes, above 100"):
        images.check(condition_png(0), Limits(max_image_bytes=100))


@pytest.fixture
def family():
    return "flux-kontext"


def test_the_server_refuses_every_hostile_image_by_index_and_keeps_serving(family_client, family):
    """One good image at index 0 and a hostile one at index 1: the violation names index 1 only."""
    good = rollout_pb2.ConditionImage(data=condition_png(0))
    for name, (data, word) in HOSTILE.items():
        request = family_request(
            family, "ODE", cfg=False, condition_images=[good, rollout_pb2.ConditionImage(data=data)]
        )
        with pytest.raises(grpc.RpcError) as refused:
            family_client.rollout(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        violations = field_violations(refused.value)
        assert [v.field for v in violations] == ["condition_images[1]"], name
        assert word in violations[0].description, name
    assert health_status(family_client.channel) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("count", [0, 1, 3])
def test_one_image_per_prompt(family_client, family, count):
    request = family_request(
        family, "ODE", cfg=False, condition_images=[rollout_pb2.ConditionImage(data=condition_png(0))] * count
    )
    with pytest.raises(grpc.RpcError) as refused:
        family_client.rollout(request)
    assert [v.field for v in field_violations(refused.value)] == ["condition_images"]


def test_a_text_model_takes_no_image(client):
    request = family_request(
        "flux", "ODE", cfg=False, condition_images=[rollout_pb2.ConditionImage(data=b"x")]
    )
    with pytest.raises(grpc.RpcError) as refused:
        client.rollout(request)
    violation = field_violations(refused.value)[0]
    assert (violation.field, violation.description) == (
        "condition_images",
        "this model takes no conditioning images",
    )


def test_the_started_event_describes_each_image_and_keeps_no_bytes(family_client, family):
    request = family_request(family, "ODE", cfg=False, samples_per_prompt=1, num_steps=1)
    started = next(iter(family_client.stream(request))).message
    assert not started.resolved.condition_images
    described = [(i.format, i.mode, i.width, i.resample) for i in started.condition_images]
    assert described == [("PNG", "RGB", 64, "none")] * 2
    assert [i.sha256 for i in started.condition_images] == [
        hashlib.sha256(image.data).hexdigest() for image in request.condition_images
    ]
    assert started.transformer_call.conditioning.env_key


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_the_prompt_cache_keys_on_the_image(family_folder, family):
    adapter = families.load(family_folder, torch.device("cpu"), torch.float32)
    shape = MediaShape(frames=5 if adapter.max_frames > 1 else 1, height=64, width=64)  # the presets' own
    first, second = (images.read(condition_png(p), Limits(), 64, 64, adapter.image_encoding) for p in (3, 4))
    cache = PromptCache(adapter, max_entries=16)
    key = adapter.conditioning.env_key

    def env(image):
        return cache.encode(["make it blue"], None, 2.5, shape, [image])

    with_first = env(first)
    assert (with_first.hits, with_first.misses) == (0, 2)  # the text's entry and the image's
    with_second = env(second)
    a, b = with_first.conditioning.envs["positive"][0], with_second.conditioning.envs["positive"][0]
    assert not torch.equal(a[key], b[key])
    if adapter.text_reads_image:  # the prompt embedding reads the image: another text entry too
        assert (with_second.hits, with_second.misses) == (0, 2)
        assert not torch.equal(a["encoder_hidden_states"], b["encoder_hidden_states"])
    else:
        assert (with_second.hits, with_second.misses) == (1, 1)
    again = env(first)
    assert (again.hits, again.misses) == (2, 0)
    fresh = PromptCache(adapter, max_entries=0).encode(["make it blue"], None, 2.5, shape, [first])
    assert_same_kwargs(again.conditioning.envs["positive"][0], fresh.conditioning.envs["positive"][0])


def test_the_cli_sends_an_image_and_saves_it_beside_the_edits(family_resources, family, tmp_path):
    """``rollout-client rollout --image in.png "make it blue"``: the contact sheet's row starts with
    the input, and each saved trajectory holds the file, what the server made of it and its latents."""
    from rollout_client.cli import EXIT_USAGE, main

    image = tmp_path / "in.png"
    image.write_bytes(condition_png(5))
    out = tmp_path / "edit"
    address = family_resources.server(family).address
    small = ["--samples-per-prompt", "2", "--steps", "2", "--height", "64", "--width", "64", "--seed", "3"]
    assert (
        main(
            [
                "rollout",
                "--address",
                address,
                "--image",
                str(image),
                "make it blue",
                *small,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    sheet = Image.open(out / "contact-sheet.png")
    row = LABEL_HEIGHT + 64
    assert sheet.size == (3 * 64, row)  # the input, then the two samples
    assert sheet.crop((0, LABEL_HEIGHT, 64, row)).tobytes() == condition_image(5).tobytes()
    assert (
        sheet.crop((64, LABEL_HEIGHT, 128, row)).tobytes()
        == Image.open(out / "sample-0.png").convert("RGB").tobytes()
    )
    trajectory = Trajectory.load(out / "sample-1.safetensors")
    assert trajectory.condition_png == image.read_bytes()
    assert trajectory.condition_image["sha256"] == hashlib.sha256(image.read_bytes()).hexdigest()
    assert trajectory.conditioning().size == (64, 64)
    assert trajectory.env["positive"]["image_latents"].shape == (1, 16, 16)  # 4 x 4 tokens of 16 channels
    # Two prompts and three images is no request.
    assert (
        main(["rollout", "--address", address, *("--image", str(image)) * 3, "a", "b", "--out", str(out)])
        == EXIT_USAGE
    )
