"""Conditioning images: hostile input, bounded before they are decoded, and decoded once.

A request's ``condition_images`` are files a client sent. Each is checked in this order, and the
first failure names its field (``condition_images[i]``):

1. its size in bytes (``Limits.max_image_bytes``), and not empty;
2. its structure, walked before any decoder sees the file, since decode work grows with it, not
   only with the bytes and pixels: at most ``MAX_SEGMENTS`` marker segments (JPEG) or chunks (PNG),
   as PIL parses a header in Python, a step per segment or stray byte; a JPEG of at most
   ``Limits.max_image_scans`` scans, as libjpeg decodes every scan of a progressive JPEG over the
   whole image (a 2048 x 2048 file whose last scan is repeated 10,000 times costs 10,000 passes,
   tens of seconds); a PNG of at most 8 bits per channel;
3. its header, parsed alone (PIL reads no pixel data on open): the format must be PNG or JPEG (no
   other decoder is ever tried), the pixel count the header states at most
   ``Limits.max_image_pixels`` (a small file that claims 100000 x 100000 pixels is a decompression
   bomb), one frame (an animated PNG is refused: which frame would condition?), and a mode that
   converts to RGB by a fixed rule, without guessing: bilevel ("1"), grayscale ("L", from 2, 4 or 8
   bits), RGB (a JPEG's YCbCr too) or a palette ("P"), with no transparent colour. 16 bits per
   channel (PIL would cut RGB to 8 bits silently), alpha, a transparent colour (tRNS) and CMYK are
   refused: each needs a rounding, colour or compositing rule the server would have to invent;
4. the pixels, decoded in full: a truncated or corrupt file fails here, before any rollout work.

A checked image is converted to RGB and resized to the request's width x height with Lanczos, as
diffusers' image processors resize (``resample="lanczos"``); an image of that size already is used
as it is. Its SHA-256 (of the file's bytes) keys the prompt cache. This happens once, at admission:
the engine's worker (and every sequence-parallel rank) works from those pixels.
"""

import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from rollout.v1 import rollout_pb2

if TYPE_CHECKING:
    from rollout_server.limits import Limits

FORMATS = ("PNG", "JPEG")
# PIL modes of at most 8 bits per channel that convert to RGB by a fixed rule.
MODES = ("1", "L", "RGB", "P")
RESAMPLE = "lanczos"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_START = b"\xff\xd8"
# Steps of the structure walk, at most: a JPEG's marker segments (some tens, two more per progressive
# scan) and stray bytes before its first scan, or a PNG's chunks (a 4 MiB PNG in libpng's 8 KiB
# IDAT chunks has 512). Beyond it a file is refused before PIL parses it a step at a time: 4 MiB of
# empty comment segments took PIL 2.1 s to open, of stray bytes 0.5 s, and 4 MiB of empty IDAT
# chunks 1.2 s to load (2 cores), each file decoding fine after that.
MAX_SEGMENTS = 4096
_SOS, _EOI = 0xDA, 0xD9


class BadImage(ValueError):
    """A conditioning image the server refuses; the message says why."""


@dataclass(frozen=True)
class ConditionImage:
    """A checked conditioning image, RGB at the request's size, and what was done to it."""

    image: Image.Image
    info: rollout_pb2.ConditionImageInfo

    @property
    def sha256(self) -> str:
        return self.info.sha256

    @property
    def nbytes(self) -> int:
        """The bytes its pixels hold."""
        return self.image.width * self.image.height * len(self.image.getbands())

    def pack(self) -> tuple[bytes, bytes]:
        """(its description, its RGB pixels), as rank 0 sends it to the other ranks."""
        return self.info.SerializeToString(), self.image.tobytes()

    @classmethod
    def unpack(cls, info: bytes, pixels: bytes) -> "ConditionImage":
        described = rollout_pb2.ConditionImageInfo.FromString(info)
        size = (described.resized_width, described.resized_height)
        return cls(Image.frombytes("RGB", size, pixels), described)


def _jpeg_scans(data: bytes, max_scans: int) -> None:
    """Walk a JPEG's marker segments as libjpeg reads them: BadImage past ``max_scans`` scans (SOS
    segments) or ``MAX_SEGMENTS`` steps. A segment is skipped by its length; a scan's entropy-coded
    data and stray bytes (0xFF 0x00 too), up to the next marker: 0xFF and a byte other than 0x00,
    0xFF or a restart marker. Before the first scan a stray byte is a step of its own, as it is to
    PIL's header parser."""
    raw = np.frombuffer(data, np.uint8)
    following = raw[1:]
    markers = np.flatnonzero(
        (raw[:-1] == 0xFF) & (following != 0x00) & (following != 0xFF) & ((following & 0xF8) != 0xD0)
    )

    def next_marker(position: int) -> int:
        index = int(np.searchsorted(markers, position))
        return int(markers[index]) if index < len(markers) else len(data)

    scans, position = 0, len(JPEG_START)
    for _ in range(MAX_SEGMENTS):
        if position + 1 >= len(data):
            return
        marker = data[position + 1]
        if data[position] != 0xFF or marker in (0x00, 0xFF):  # a stray or fill byte
            position = next_marker(position) if scans else position + 1
        elif marker == _EOI:
            return
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            position += 2
        else:
            # libjpeg skips a length below 2 as 2, and refuses a segment whose content disagrees.
            position += 2 + max(2, int.from_bytes(data[position + 2 : position + 4], "big"))
            if marker == _SOS:
                scans += 1
                if scans > max_scans:
                    raise BadImage(
                        f"has more than {max_scans} scans: libjpeg decodes each over the whole image"
                    )
                position = next_marker(position)
    raise BadImage(f"has more than {MAX_SEGMENTS} marker segments (or stray bytes between them)")


def _png_bit_depth(data: bytes) -> int:
    """A PNG's bits per channel, from its IHDR chunk (which must come first), once its chunks are
    counted: BadImage past ``MAX_SEGMENTS`` of them."""
    if len(data) < 25 or data[12:16] != b"IHDR":
        raise BadImage("is not a PNG or JPEG image (or its header is corrupt)")
    position = len(PNG_SIGNATURE)
    for _ in range(MAX_SEGMENTS):
        if position + 8 > len(data) or data[position + 4 : position + 8] == b"IEND":
            return data[24]
        position += 12 + int.from_bytes(data[position : position + 4], "big")  # length, type, data, CRC
    raise BadImage(f"has more than {MAX_SEGMENTS} chunks")


def _open(data: bytes, limits: "Limits") -> Image.Image:
    """The image with its header parsed and its pixels not yet read; BadImage if the file is not one
    the server decodes."""
    if not data:
        raise BadImage("is empty: a PNG or JPEG file is required")
    if len(data) > limits.max_image_bytes:
        raise BadImage(f"has {len(data)} bytes, above {limits.max_image_bytes}")
    if data.startswith(PNG_SIGNATURE) and (bits := _png_bit_depth(data)) > 8:
        raise BadImage(f"has {bits} bits per channel: 8 at most (convert it to 8 bits first)")
    if data.startswith(JPEG_START):
        _jpeg_scans(data, limits.max_image_scans)
    try:
        with warnings.catch_warnings():
            # PIL warns of large images and raises for very large ones: the pixel bound below
            # decides, with a message naming it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise BadImage(f"states more than {limits.max_image_pixels} pixels") from None
    except Exception:  # every decoder error means the same to the client
        raise BadImage("is not a PNG or JPEG image (or its header is corrupt)") from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise BadImage(f"states {width} x {height} pixels, above {limits.max_image_pixels}")
    if getattr(image, "n_frames", 1) != 1:
        raise BadImage(f"has {image.n_frames} frames: one still image is required")
    if image.mode not in MODES:
        raise BadImage(
            f"has mode {image.mode!r}: bilevel, grayscale, RGB or palette images without alpha only"
        )
    if "transparency" in image.info:
        raise BadImage("has a transparent colour (tRNS): flatten it onto a background first")
    return image


def check_header(data: bytes, limits: "Limits") -> None:
    """BadImage if one conditioning image is refused before its pixels are decoded (1 to 3 above)."""
    _open(data, limits)


def read(data: bytes, limits: "Limits", width: int, height: int, encoding: str) -> ConditionImage:
    """One conditioning image, checked, decoded, converted to RGB and resized to ``width`` x
    ``height``; BadImage if it is refused. ``encoding`` says how the family encodes it."""
    image = _open(data, limits)
    try:
        image.load()
    except Exception:
        raise BadImage("is truncated or corrupt: its pixels do not decode") from None
    rgb = image.convert("RGB")
    resized = rgb.size != (width, height)
    if resized:
        rgb = rgb.resize((width, height), Image.Resampling.LANCZOS)
    info = rollout_pb2.ConditionImageInfo(
        sha256=hashlib.sha256(data).hexdigest(),
        format=image.format,
        mode=image.mode,
        width=image.width,
        height=image.height,
        resized_width=width,
        resized_height=height,
        resample=RESAMPLE if resized else "none",
        encoding=encoding,
    )
    return ConditionImage(rgb, info)
