"""Rewards for a trainer: callables on decoded images and their prompts.

A reward is any ``Reward``: ``reward(images, prompts) -> float32 tensor [N]``, one value per image,
higher is better. The trainer passes the rollout's PIL images (prompt-major order) and the prompt of
each.
"""

import io
from collections.abc import Callable, Sequence

import torch
from PIL import Image

Reward = Callable[[Sequence[Image.Image], Sequence[str]], torch.Tensor]


def jpeg_size_kb(image: Image.Image, quality: int = 95) -> float:
    """Size of ``image`` as an RGB JPEG at ``quality``, in kB (1000 bytes)."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


def jpeg_compressibility(images: Sequence[Image.Image], prompts: Sequence[str]) -> torch.Tensor:
    """FlowGRPO's download-free reward: ``-size_kB / 500`` of each image as a JPEG at quality 95.
    Images that compress better score higher; the prompts are not used."""
    return torch.tensor([-jpeg_size_kb(image) / 500 for image in images], dtype=torch.float32)
