"""Ulysses attention's exchanges, for the families whose attention processors split the heads
themselves (diffusers' own context-parallel attention runs its own).

Under a Ulysses split each of N ranks holds a part of the tokens with every head, laid out as
diffusers' attention takes them: [..., tokens, heads, head dim]. Before attention,
``to_heads`` gives each rank every rank's tokens, in rank order, for its share of the heads (H / N,
rank r the r-th); after it, ``to_tokens`` gives each rank its own tokens back with every head. The
parts may be uneven (diffusers' ``ulysses_anything``: ``split_sizes``). These move bytes and do no
arithmetic, so the attention sees SP=1's values, in its order, on every rank; inference only (no
autograd through them).
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def split_sizes(tokens: int, ranks: int) -> list[int]:
    """Each rank's part of ``tokens`` as ``tensor_split`` cuts them (diffusers' ``ulysses_anything``):
    the first ``tokens % ranks`` parts one longer."""
    return [tokens // ranks + (rank < tokens % ranks) for rank in range(ranks)]


def place(parallel_config: Any) -> tuple[int, int, Any] | None:
    """The Ulysses degree, this rank's place in it and its process group, of a module diffusers'
    ``enable_parallelism`` split (``parallel_config``: its ``_parallel_config``); None when not split."""
    if parallel_config is None:
        return None
    config = parallel_config.context_parallel_config
    return config.ulysses_degree, config._ulysses_local_rank, config._ulysses_mesh.get_group()


def to_heads(
    parts: Sequence[torch.Tensor], sizes: list[int], group: Any, out: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Ulysses' first all-to-all, one for several tensors: each of ``parts`` [..., s, H_i, d] holds
    this rank's s tokens with every one of its heads (the parts' head counts may differ, as query and
    key/value heads do under GQA; each divides by the ranks), the other dims alike. Returns each part
    as [sum(sizes), ..., H_i / N, d]: every rank's tokens in rank order, first, for this rank's share
    of the heads; views of one tensor, ``out`` when given. ``sizes``: each rank's token count."""
    ranks = len(sizes)
    shares = [part.shape[-2] // ranks for part in parts]
    by_rank = [part.unflatten(-2, (ranks, -1)) for part in parts]  # [..., s, N, H_i / N, d]
    send = by_rank[0] if len(parts) == 1 else torch.cat(by_rank, dim=-2)
    # Rank r's heads of every token, for rank r, in rank order.
    send = send.movedim((-3, -4), (0, 1)).contiguous()
    received = out if out is not None else send.new_empty(sum(sizes), *send.shape[2:])
    dist.all_to_all_single(
        received,
        send.flatten(0, 1),
        output_split_sizes=sizes,
        input_split_sizes=[send.shape[1]] * ranks,
        group=group,
    )
    return list(received.split(shares, dim=-2))


def to_tokens(heads: torch.Tensor, sizes: list[int], rank: int, group: Any) -> torch.Tensor:
    """The all-to-all back: ``heads`` [..., sum(sizes), H / N, d] (every rank's tokens in rank order,
    this rank's share of the heads) to [..., sizes[rank], H, d] (this rank's tokens, every head in rank
    order), contiguous."""
    ranks, count = len(sizes), sizes[rank]
    send = heads.movedim(-3, 0).contiguous()
    received = send.new_empty(ranks * count, *send.shape[1:])
    dist.all_to_all_single(
        received, send, output_split_sizes=[count] * ranks, input_split_sizes=sizes, group=group
    )
    # [N, count, ..., H / N, d]: rank r's share of the heads of this rank's tokens. The tokens go back
    # to their dim and the ranks before the shares, which then flatten into every head.
    return received.unflatten(0, (ranks, count)).movedim(1, -3).movedim(0, -3).flatten(-3, -2)


def gather(part: torch.Tensor, sizes: list[int], rank: int, group: Any) -> torch.Tensor:
    """Every rank's ``part`` [sizes[rank], ...] in rank order (an all-gather of uneven parts, as an
    all-to-all that sends each rank the same part)."""
    ranks = len(sizes)
    gathered = part.new_empty(sum(sizes), *part.shape[1:])
    send = part.expand(ranks, *part.shape).contiguous().flatten(0, 1)
    dist.all_to_all_single(
        gathered, send, output_split_sizes=sizes, input_split_sizes=[sizes[rank]] * ranks, group=group
    )
    return gathered
