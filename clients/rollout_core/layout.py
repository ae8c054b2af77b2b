"""How a rollout request's samples are laid out: the one rule a server resolves requests by, and that a
pool of replicas relies on to split a request into prompt groups that draw the noise one server would.

* the group size is ``samples_per_prompt`` (the server's default, 1, when unset); sample k belongs to
  prompt ``k // group_size`` (prompt-major);
* the seeds are the request's own (one per sample, distinct; a ``base_seed`` given too must derive
  exactly them), or ``noise.derive_seeds(base_seed, count)``, with a random 64-bit ``base_seed``
  when the request has none;
* the request id is the request's own, or 16 hexadecimal digits of a random UUID.
"""

import secrets
import uuid
from dataclasses import dataclass

from rollout.v1 import rollout_pb2
from rollout_core.noise import derive_seeds

DEFAULT_GROUP_SIZE = 1


@dataclass(frozen=True)
class SampleLayout:
    """A request's samples: who they belong to and the seed each one draws its noise from."""

    request_id: str
    group_size: int
    seeds: tuple[int, ...]  # prompt-major, one per sample
    base_seed: int | None  # the base seed the seeds were derived from, if they were

    @property
    def prompt_indices(self) -> list[int]:
        return [k // self.group_size for k in range(len(self.seeds))]

    def group_seeds(self, prompt_index: int) -> tuple[int, ...]:
        """The seeds of prompt ``prompt_index``'s group."""
        return self.seeds[prompt_index * self.group_size : (prompt_index + 1) * self.group_size]


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def sample_layout(
    request: rollout_pb2.RolloutRequest, max_samples: int
) -> tuple[SampleLayout | None, list[tuple[str, str]]]:
    """The layout of ``request``'s samples, or None with the (field, description) of each problem that
    prevents one. Prompts themselves are not checked; at most ``max_samples`` seeds are derived."""
    group = request.samples_per_prompt if request.HasField("samples_per_prompt") else DEFAULT_GROUP_SIZE
    count = group * len(request.prompts)
    problems = []
    if group < 1:
        problems.append(("samples_per_prompt", "must be at least 1"))
    elif len(request.prompts) <= max_samples < count:  # more prompts than that are refused as such
        problems.append(
            ("samples_per_prompt", f"prompts x samples_per_prompt = {count} exceeds {max_samples}")
        )
    base_seed = request.base_seed if request.HasField("base_seed") else None
    if request.seeds:
        seeds = tuple(request.seeds)
        if len(seeds) != count:
            problems.append(("seeds", f"expected {count} seeds (one per sample), got {len(seeds)}"))
        elif len(set(seeds)) != len(seeds):
            problems.append(("seeds", "seeds must be distinct: equal seeds draw identical noise"))
        # Both are accepted only when they agree, so a started event's resolved request can be resent.
        elif base_seed is not None and list(seeds) != derive_seeds(base_seed, len(seeds)):
            problems.append(("base_seed", "seeds are not the ones base_seed derives; give one or the other"))
    else:
        if base_seed is None:
            base_seed = secrets.randbits(64)
        seeds = tuple(derive_seeds(base_seed, count)) if 0 < count <= max_samples else ()
    if problems or not request.prompts:
        return None, problems
    return SampleLayout(request.request_id or new_request_id(), group, seeds, base_seed), problems


def prompt_groups(
    request: rollout_pb2.RolloutRequest, layout: SampleLayout, prompt_indices
) -> rollout_pb2.RolloutRequest:
    """``request`` cut to the groups of ``prompt_indices`` (in that order, with their conditioning
    images and their rows of a trainer's x_0), with the seeds, group size and request id of its
    ``layout``: the part draws the noise the whole request would."""
    part = rollout_pb2.RolloutRequest()
    part.CopyFrom(request)
    part.request_id = layout.request_id
    part.samples_per_prompt = layout.group_size
    part.ClearField("base_seed")
    del part.prompts[:], part.seeds[:], part.condition_images[:]
    part.prompts.extend(request.prompts[p] for p in prompt_indices)
    if request.condition_images:  # one per prompt
        part.condition_images.extend(request.condition_images[p] for p in prompt_indices)
    part.seeds.extend(seed for p in prompt_indices for seed in layout.group_seeds(p))
    if request.initial_latents:
        group = layout.group_size
        rows = [k for p in prompt_indices for k in range(p * group, (p + 1) * group)]
        part.initial_latents = _initial_latent_rows(request.initial_latents, rows)
    return part


def _initial_latent_rows(data: bytes, rows: list[int]) -> bytes:
    """The rows ``rows`` of a request's x_0 buffer; the buffer as it is when it is not one the rows
    can be cut from (a server then refuses it, naming the field)."""
    from safetensors.torch import load

    from rollout_core import wire

    try:
        x0 = load(data)[wire.X_0]
        if len(x0) <= max(rows):
            return data
    except Exception:  # noqa: BLE001 - the server names what is wrong with it
        return data
    return wire.initial_latents_bytes(x0[rows])
