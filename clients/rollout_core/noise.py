"""Per-sample seeds and the noise derivation rule.

The server owns the noise, and every draw is reproducible from a sample's 64-bit seed alone:

* per-sample seeds: explicit in the request, or derived from a base seed as
  ``seed_k = splitmix64(base_seed + k)`` for the k-th sample (prompt-major), modulo 2**64;
* noise stream ``j`` of a sample (``j = 0`` is the initial latent x_0, ``j = i + 1`` the eps of step i)
  comes from ``torch.Generator("cpu").manual_seed(noise_seed(seed, j))`` with
  ``noise_seed(seed, j) = splitmix64(seed ^ splitmix64(j))``;
* each draw is ``torch.randn(latent_shape, generator=g, dtype=torch.float32)`` at the full
  (unsharded) shape of one sample's latent, on the CPU, then moved to the device.

Several latent streams per sample (``rollout_core.latent_streams``; LTX-2: video, then audio): latent
stream ``k`` draws noise stream ``j`` at its own shape from
``noise_seed(seed, j + k * 2**32) = splitmix64(seed ^ splitmix64(j + k * 2**32))``, and the joint draw
is the streams' draws flattened and concatenated in stream order. Stream 0's rule is the one above, so
a family with one stream draws what it always did.

Tree rollouts: at a branch step ``b``, child ``c`` of a node with seed ``S`` draws its eps of step b
and later from its own seed ``child_seed(S, b, c)``: ``S`` itself for ``c = 0`` (so a tree whose
factors are all 1 is the flat rollout, bitwise), else ``splitmix64(S ^ splitmix64(2**63 + b * 2**32 + c))``
(the top bit keeps these apart from the stream indices of ``noise_seed``).

So a sample's noise depends on neither the batch it ran in, nor which steps were stochastic, nor the
device, nor the sequence-parallel degree; a trainer can regenerate any eps with ``step_noise``.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout_core.latent_streams import LatentStream

MASK64 = (1 << 64) - 1
NOISE_RULE = (
    "seed_k = splitmix64(base_seed + k); stream j (0 = x_0, i + 1 = eps of step i) = "
    "torch.randn(latent_shape, float32) from torch.Generator('cpu').manual_seed("
    "splitmix64(seed ^ splitmix64(j))); tree child c at branch step b: seed = child_seed(parent seed, b, c) "
    "= parent seed if c == 0 else splitmix64(parent seed ^ splitmix64(2**63 + b * 2**32 + c))"
)
# The started event's rule when a sample has several latent streams.
STREAMS_RULE = (
    "; several latent streams (transformer_call.streams): latent stream k draws noise stream j at its own "
    "shape from torch.Generator('cpu').manual_seed(splitmix64(seed ^ splitmix64(j + k * 2**32))), and the "
    "joint draw is the streams' draws flattened and concatenated in stream order"
)


def splitmix64(value: int) -> int:
    """The SplitMix64 finaliser (Steele, Lea and Flood, 2014): a bijective 64-bit mixer."""
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def derive_seeds(base_seed: int, count: int) -> list[int]:
    """Per-sample seeds from a base seed: ``splitmix64(base_seed + k)`` for k in range(count)."""
    return [splitmix64((base_seed + k) & MASK64) for k in range(count)]


def noise_seed(seed: int, stream: int) -> int:
    """Generator seed of noise stream ``stream`` (0 = x_0, i + 1 = eps of step i) of one sample."""
    return splitmix64(seed ^ splitmix64(stream))


def child_seed(parent_seed: int, step: int, child: int) -> int:
    """The seed of child ``child`` of a tree node with ``parent_seed`` that forks at ``step``."""
    if child == 0:
        return parent_seed
    return splitmix64(parent_seed ^ splitmix64((1 << 63) + (step << 32) + child))


def draw(
    seeds: Sequence[int], stream: int, latent_shape: Sequence[int], streams: Sequence["LatentStream"] = ()
) -> torch.Tensor:
    """Stack one float32 draw of ``latent_shape`` per sample seed: shape [len(seeds), *latent_shape].
    With several latent ``streams``, each row is their joint draw and ``latent_shape`` its [N]."""
    generator = torch.Generator("cpu")
    draws = []
    for seed in seeds:
        if len(streams) < 2:
            generator.manual_seed(noise_seed(seed, stream))
            draws.append(torch.randn(tuple(latent_shape), generator=generator, dtype=torch.float32))
            continue
        parts = []
        for k, latent_stream in enumerate(streams):
            generator.manual_seed(noise_seed(seed, stream + (k << 32)))
            parts.append(torch.randn(latent_stream.shape, generator=generator, dtype=torch.float32).flatten())
        draws.append(torch.cat(parts))
    return torch.stack(draws)


def initial_noise(
    seeds: Sequence[int], latent_shape: Sequence[int], streams: Sequence["LatentStream"] = ()
) -> torch.Tensor:
    """x_0 of each sample, float32 [B, *latent_shape] on the CPU."""
    return draw(seeds, 0, latent_shape, streams)


def step_noise(
    seeds: Sequence[int], step: int, latent_shape: Sequence[int], streams: Sequence["LatentStream"] = ()
) -> torch.Tensor:
    """eps of step ``step`` of each sample, float32 [B, *latent_shape] on the CPU."""
    return draw(seeds, step + 1, latent_shape, streams)
