"""Conditioning images are hostile input: each bad file is refused with INVALID_ARGUMENT naming
``condition_images[i]``, before any work (a scan bomb before any decode), and the server stays
SERVING; a good one is decoded once, at admission, read by the mode table, resized and described in
the started event; images at the byte limit reach the image check, never gRPC's receive limit. The
prompt cache keys on the image: the same text with another image is another env, the same text and
image a hit that is bitwise what encoding gives."""

import asyncio
import contextlib
import hashlib
import io
import logging
import re
import struct
import threading
import zlib
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2
from PIL import Image
from support.errors import field_violations, health_status
from support.families import FAMILIES, family_request
from support.parity import assert_same_kwargs
from support.requests import condition_image, condition_png

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client import RolloutClient, Trajectory
from rollout_client.channel import RETRY_BUFFER_BYTES
from rollout_client.images import LABEL_HEIGHT
from rollout_server import families, images
from rollout_server.engine import Engine
from rollout_server.families.base import MediaShape
from rollout_server.limits import Limits
from rollout_server.presets import defaults_for
from rollout_server.prompt_cache import PromptCache
from rollout_server.server import RolloutServer, rollout_service
from rollout_server.validation import ServingContext

IMAGE_FAMILIES = ["flux-kontext", "qwen-image-edit", "wan-i2v"]
SHAPE = MediaShape(frames=1, height=64, width=64)


def encoded(image: Image.Image, format: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_by_hand(width: int, height: int, bits: int, colour_type: int, rows: list[bytes]) -> bytes:
    """A PNG written chunk by chunk (what Pillow does not write: 2-bit grayscale, 16-bit RGB), each
    row unfiltered."""
    header = struct.pack(">IIBBBBB", width, height, bits, colour_type, 0, 0, 0)
    pixels = zlib.compress(b"".join(b"\x00" + row for row in rows))
    return (
        images.PNG_SIGNATURE
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", pixels)
        + png_chunk(b"IEND", b"")
    )


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header states ``width`` x ``height`` RGB pixels, with no pixel data."""
    return png_by_hand(width, height, 8, 2, [])


def padded_png(size: int) -> bytes:
    """A valid PNG of exactly ``size`` bytes: a conditioning image with a private ancillary chunk of
    zeros before its IEND (12 bytes), which decoders skip."""
    png = condition_png(0)
    return png[:-12] + png_chunk(b"prVt", bytes(size - len(png) - 12)) + png[-12:]


def progressive_jpeg(side: int = 2048) -> bytes:
    """A flat colour at ``side`` x ``side``, progressive: libjpeg's 10 scans, the last one (the luma's
    AC refinement) 18 bytes."""
    return encoded(Image.new("RGB", (side, side), (120, 80, 200)), "JPEG", progressive=True)


def scan_bomb(jpeg: bytes, repeats: int) -> bytes:
    """``jpeg`` with its last scan (SOS segment and entropy-coded data, up to EOI) ``repeats`` times
    over: libjpeg decodes each over the whole image. Its last 0xFF 0xDA is the last scan's marker,
    as entropy-coded data holds none."""
    last = jpeg.rindex(b"\xff\xda")
    return jpeg[:last] + jpeg[last:-2] * repeats + jpeg[-2:]


def hostile_images() -> dict[str, tuple[bytes, str]]:
    """Bad files, each with a word its refusal must say."""
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    palette = rgb.convert("P")
    palette.info["transparency"] = 0
    frames = [rgb, rgb.rotate(90)]
    png, jpeg = encoded(rgb), encoded(rgb, "JPEG")
    over = images.MAX_SEGMENTS + 1
    return {
        "truncated": (encoded(rgb)[:1500], "truncated"),
        "100000x100000 header": (png_claiming(100_000, 100_000), "pixels"),
        "cmyk": (encoded(rgb.convert("CMYK"), "JPEG"), "CMYK"),
        "16-bit": (encoded(Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16))), "16 bits"),
        "palette with transparency": (encoded(palette, transparency=0), "transparent"),
        "animated gif": (encoded(rgb, "GIF", save_all=True, append_images=frames[1:]), "PNG or JPEG"),
        "animated png": (encoded(rgb, "PNG", save_all=True, append_images=frames[1:]), "frames"),
        "zero bytes": (b"", "empty"),
        "not an image": (b"GIF89a? no: a text file\n" * 4, "PNG or JPEG"),
        "scan bomb": (scan_bomb(progressive_jpeg(), 10_000), "scans"),
        "comment flood": (jpeg[:2] + b"\xff\xfe\x00\x02" * over + jpeg[2:], "marker segments"),
        "stray bytes": (jpeg[:20] + b"\x00" * over + jpeg[20:], "stray bytes"),  # after its APP0
        "chunk flood": (png[:-12] + png_chunk(b"IDAT", b"") * over + png[-12:], "chunks"),
    }


HOSTILE = hostile_images()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_hostile_file_is_refused_with_a_reason(name):
    data, word = HOSTILE[name]
    with pytest.raises(images.BadImage, match=word):
        images.read(data, Limits(), 64, 64, "latents")


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


def decodes(monkeypatch) -> list[str]:
    """The thread of each decode of a file from now on: PIL asks for a PNG ("zip") or JPEG decoder
    once per decode (its "raw" decoder only copies pixels, as ``Image.frombytes`` does)."""
    threads = []
    get_decoder = Image._getdecoder

    def counted(mode, decoder_name, *args, **kwargs):
        if decoder_name in ("zip", "jpeg"):
            threads.append(threading.current_thread().name)
        return get_decoder(mode, decoder_name, *args, **kwargs)

    monkeypatch.setattr(Image, "_getdecoder", counted)
    return threads


def test_a_scan_bomb_is_refused_before_any_decode(monkeypatch):
    """A flat 2048 x 2048 progressive JPEG whose 18-byte last scan is repeated 10,000 times: 185 KB
    that libjpeg would decode 10,000 times over the whole image. It is refused, naming its scans,
    before PIL is asked for a decoder; the JPEG it was made from decodes, once. The bound counts the
    scans exactly: libjpeg's 10 pass a bound of 10, not one of 9."""
    threads = decodes(monkeypatch)
    jpeg = progressive_jpeg()
    bomb = scan_bomb(jpeg, 10_000)
    assert len(bomb) < 200_000
    with pytest.raises(images.BadImage, match=f"more than {Limits().max_image_scans} scans"):
        images.read(bomb, Limits(), 64, 64, "latents")
    assert threads == []
    images.read(jpeg, Limits(), 64, 64, "latents")
    assert len(threads) == 1
    images.check_header(jpeg, Limits(max_image_scans=10))
    with pytest.raises(images.BadImage, match="more than 9 scans"):
        images.check_header(jpeg, Limits(max_image_scans=9))


def mode_table() -> dict[str, tuple[bytes, str | None, np.ndarray | None]]:
    """Each kind of file: (its bytes, the mode it is read as, or None if refused, then the RGB pixels
    it must become, or None where JPEG's loss leaves them to libjpeg) or (bytes, None, the word its
    refusal says). Pixels are 8 x 8, and each expectation is the documented rule applied by hand."""
    values = np.arange(64, dtype=np.uint8).reshape(8, 8)
    grey = values * 4
    rgb = np.stack([grey, 255 - grey, np.full_like(grey, 7)], axis=-1)
    bits = values % 3 == 0
    two_bits = values % 4
    packed = [
        bytes((a << 6) | (b << 4) | (c << 2) | d for a, b, c, d in row.reshape(-1, 4).tolist())
        for row in two_bits
    ]
    palette = np.random.default_rng(1).integers(0, 256, (256, 3), dtype=np.uint8)
    indexed = Image.fromarray(values % 16, "P")
    indexed.putpalette(palette.flatten().tolist())
    full_index = Image.fromarray(grey, "P")
    full_index.putpalette(palette.flatten().tolist())
    sixteen = [np.full(8 * 3, 40000, dtype=">u2").tobytes()] * 8
    return {
        "png 1-bit": (encoded(Image.fromarray(bits)), "1", np.repeat(bits[..., None] * 255, 3, axis=-1)),
        "png 2-bit grey": (png_by_hand(8, 8, 2, 0, packed), "L", np.repeat(two_bits[..., None] * 85, 3, -1)),
        "png 8-bit grey": (encoded(Image.fromarray(grey)), "L", np.repeat(grey[..., None], 3, axis=-1)),
        "png rgb": (encoded(Image.fromarray(rgb)), "RGB", rgb),
        "png 4-bit palette": (encoded(indexed, bits=4), "P", palette[values % 16]),
        "png 8-bit palette": (encoded(full_index), "P", palette[grey]),
        "jpeg grey": (encoded(Image.fromarray(grey), "JPEG"), "L", None),
        "jpeg rgb": (encoded(Image.fromarray(rgb), "JPEG"), "RGB", None),
        "jpeg progressive": (encoded(Image.fromarray(rgb), "JPEG", progressive=True), "RGB", None),
        "png 16-bit rgb": (png_by_hand(8, 8, 16, 2, sixteen), None, "16 bits per channel"),
        "png 16-bit grey": (
            encoded(Image.fromarray(grey.astype(np.uint16) * 257)),
            None,
            "16 bits per channel",
        ),
        "png grey with tRNS": (encoded(Image.fromarray(grey), transparency=0), None, "transparent colour"),
        "png rgb with tRNS": (
            encoded(Image.fromarray(rgb), transparency=(0, 255, 7)),
            None,
            "transparent colour",
        ),
        "png palette with tRNS": (encoded(indexed, transparency=3), None, "transparent colour"),
        "png grey + alpha": (encoded(Image.fromarray(rgb).convert("LA")), None, "mode 'LA'"),
        "png rgba": (encoded(Image.fromarray(rgb).convert("RGBA")), None, "mode 'RGBA'"),
        "jpeg cmyk": (encoded(Image.fromarray(rgb).convert("CMYK"), "JPEG"), None, "mode 'CMYK'"),
    }


MODE_TABLE = mode_table()


@pytest.mark.parametrize("name", list(MODE_TABLE))
def test_the_mode_table(name):
    """The table of docs/protocol.md, file by file: read as the mode it names and converted by its
    rule, or refused saying why."""
    data, mode, outcome = MODE_TABLE[name]
    if mode is None:
        with pytest.raises(images.BadImage, match=re.escape(outcome)):
            images.read(data, Limits(), 8, 8, "latents")
        return
    read = images.read(data, Limits(), 8, 8, "latents")
    assert (read.info.mode, read.image.mode, read.info.resample) == (mode, "RGB", "none")
    if outcome is not None:
        assert np.array_equal(np.asarray(read.image), outcome)


def test_the_pixel_bound_is_read_from_the_header_before_decoding():
    limits = Limits(max_image_pixels=64 * 63)
    with pytest.raises(images.BadImage, match="64 x 64 pixels, above 4032"):
        images.check_header(condition_png(0), limits)
    with pytest.raises(images.BadImage, match="bytes, above 100"):
        images.check_header(condition_png(0), Limits(max_image_bytes=100))


def test_image_limits_that_leave_no_room_for_the_largest_request_are_refused():
    """16 files of 128 MiB pass gRPC's 2 GiB message bound; a queue bound below one request's pixels
    (16 images at 2048 x 2048) would refuse that request for ever."""
    Limits().check()
    with pytest.raises(ValueError, match="gRPC's receive limit"):
        Limits(max_image_bytes=128 * 2**20).check()
    with pytest.raises(ValueError, match=f"max_queued_image_bytes must be at least {16 * 2048**2 * 3}"):
        Limits(max_queued_image_bytes=2**20).check()


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


def test_images_at_the_byte_limit_reach_the_image_check_not_grpcs_limit(family_client, family):
    """The receive limit makes room for max_condition_images files of max_image_bytes: a request of
    16 such files is read, one byte more in a file is refused naming it, and one image more is
    refused by count; never gRPC's RESOURCE_EXHAUSTED. The client's retry buffer holds such a
    request."""
    limits = Limits()
    limit, count = limits.max_image_bytes, limits.max_condition_images
    info = family_client.server_info().limits
    assert (info.max_image_bytes, info.max_condition_images) == (limit, count)
    assert info.max_request_bytes == limits.max_request_bytes(takes_images=True) == RETRY_BUFFER_BYTES
    at_limit = padded_png(limit)
    assert len(at_limit) == limit

    def request(files: list[bytes]) -> rollout_pb2.RolloutRequest:
        return family_request(
            family,
            "ODE",
            cfg=False,
            prompts=[f"make it blue {p}" for p in range(len(files))],
            samples_per_prompt=1,
            num_steps=1,
            condition_images=[rollout_pb2.ConditionImage(data=data) for data in files],
        )

    started = next(iter(family_client.stream(request([at_limit] * count)))).message
    assert [i.sha256 for i in started.condition_images] == [hashlib.sha256(at_limit).hexdigest()] * count
    for files, field, description in (
        ([at_limit, padded_png(limit + 1)], "condition_images[1]", f"has {limit + 1} bytes, above {limit}"),
        (
            [condition_png(0)] * (count + 1),
            "condition_images",
            f"{count + 1} images: at most {count} in one request",
        ),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            family_client.rollout(request(files))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [(v.field, v.description) for v in field_violations(refused.value)] == [(field, description)]


@contextlib.contextmanager
def in_process_server(adapter, preset: str, limits: Limits) -> Iterator[str]:
    """The address of a server running in this process (its event loop on a thread of its own) on
    ``adapter``, so that what its threads do can be seen."""
    engine = Engine(lambda: adapter, preset, limits)
    serving = ServingContext(adapter, defaults_for(preset, adapter.defaults()), limits)
    service = rollout_service(engine, engine.metrics, serving, rollout_pb2.GetServerInfoResponse())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="event-loop")
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=120)

    async def start() -> RolloutServer:
        server = RolloutServer(service, "127.0.0.1", 0, grace_seconds=0)
        await server.start()
        return server

    server = run(start())
    try:
        yield server.address
    finally:
        run(server.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_each_image_is_decoded_once_at_admission_and_never_on_the_worker(
    family_resources, family, monkeypatch
):
    """Two conditioning images, each decoded once, on the thread admission runs on; the engine's
    worker encodes their pixels and decodes no file, and the rollout streams to its end."""
    request = family_request(family, "ODE", cfg=False, samples_per_prompt=1, num_steps=2)
    adapter = family_resources.adapter(family)
    server = in_process_server(adapter, FAMILIES[family].preset, Limits())
    with server as address, RolloutClient(address, timeout=120) as client:
        threads = decodes(monkeypatch)
        trajectories = client.rollout(request)
    assert len(trajectories) == 2
    assert len(threads) == len(request.condition_images)
    assert "rollout-worker" not in threads and "event-loop" not in threads, threads


@contextlib.contextmanager
def logged(text: str) -> Iterator[None]:
    """Run the body, then wait until the server logs a message containing ``text``."""
    seen = threading.Event()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                seen.set()

    handler = Handler()
    service_log = logging.getLogger("rollout_server.admission")
    service_log.addHandler(handler)
    try:
        yield
        assert seen.wait(timeout=60), text
    finally:
        service_log.removeHandler(handler)


def test_requests_waiting_for_a_policy_version_hold_at_most_the_image_bound(family_resources, family, caplog):
    """Bound: one request's two 64 x 64 images. While it waits for policy version 1, a second such
    request is refused with RESOURCE_EXHAUSTED saying why; once the first has left, the second
    waits in its place."""
    image_bytes = 64 * 64 * 3
    # Room for that request alone: two images at most, 64 pixels a side.
    limits = Limits(max_queued_image_bytes=2 * image_bytes, max_condition_images=2, max_side=64)
    request = family_request(
        family, "ODE", cfg=False, samples_per_prompt=1, num_steps=1, min_policy_version=1
    )
    caplog.set_level(logging.INFO, logger="rollout_server.admission")
    server = in_process_server(family_resources.adapter(family), FAMILIES[family].preset, limits)
    with server as address, RolloutClient(address, timeout=60, retry=None) as client:
        stub = rollout_pb2_grpc.RolloutServiceStub(client.channel)
        with logged("waits for policy version 1"):
            first = stub.Rollout(request)  # the call starts at once; nothing comes back
        with pytest.raises(grpc.RpcError) as refused:
            client.rollout(request)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"hold {2 * image_bytes} bytes of conditioning images" in refused.value.details()
        with logged("gave up waiting for policy version 1"):
            first.cancel()
        with logged("waits for policy version 1"):
            second = stub.Rollout(request)
        second.cancel()


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
