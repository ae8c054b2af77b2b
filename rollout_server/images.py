"""Conditioning images: hostile input, bounded before they are decoded.

A request's ``condition_images`` are files a client sent. Each is checked in this order, and the
first failure names its field (``condition_images[i]``):

1. its size in bytes (``Limits.max_image_bytes``), and not empty;
2. its header, parsed alone (PIL reads no pixel data on open): the format must be PNG or JPEG (no
   other decoder is ever tried), the pixel count the header states at most
   ``Limits.max_image_pixels`` (a small file that claims 100000 x 100000 pixels is a decompression
   bomb), one frame (an animated PNG is refused: which frame would condition?), and a mode that
   converts to RGB without guessing: 8-bit grayscale ("L"), RGB, or a palette ("P") without
   transparency. CMYK, 16-bit, alpha and transparent palettes are refused: each needs a colour or
   compositing rule the server would have to invent;
3. the pixels, decoded in full: a truncated or corrupt file fails here, before any rollout work.

A checked image is converted to RGB and resized to the request's width x height with Lanczos, as
diffusers' image processors resize (``resample="lanczos"``); an image of that size already is used
as it is. Its SHA-256 (of the file's bytes) keys the prompt cache.
"""

import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image

from rollout.v1 import rollout_pb2

if TYPE_CHECKING:
    from rollout_server.limits import Limits

FORMATS = ("PNG", "JPEG")
# PIL modes that are one 8-bit value per channel and convert to RGB by a fixed rule.
MODES = ("L", "RGB", "P")
RESAMPLE = "lanczos"


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


def _open(data: bytes, limits: "Limits") -> Image.Image:
    """The image with its header parsed and its pixels not yet read; BadImage if the header is not
    one the server decodes."""
    if not data:
        raise BadImage("is empty: a PNG or JPEG file is required")
    if len(data) > limits.max_image_bytes:
        raise BadImage(f"has {len(data)} bytes, above {limits.max_image_bytes}")
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
        raise BadImage(f"has mode {image.mode!r}: 8-bit grayscale, RGB or palette images only")
    if image.mode == "P" and "transparency" in image.info:
        raise BadImage("is a palette image with transparency: flatten it onto a background first")
    return image


def check(data: bytes, limits: "Limits") -> Image.Image:
    """One conditioning image, checked and decoded (in its own mode); BadImage if it is refused."""
    image = _open(data, limits)
    try:
        image.load()
    except Exception:
        raise BadImage("is truncated or corrupt: its pixels do not decode") from None
    return image


def read(data: bytes, limits: "Limits", width: int, height: int, encoding: str) -> ConditionImage:
    """One conditioning image, checked, decoded, converted to RGB and resized to ``width`` x
    ``height``; BadImage if it is refused. ``encoding`` says how the family encodes it."""
    image = check(data, limits)
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
