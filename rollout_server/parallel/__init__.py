"""Sequence parallelism: every torch.distributed concern of the server, one module per concern.

* ``mesh``: the ranks' layout (``ParallelDims``), their process group and device mesh, and this
  process's place among them (``SequenceParallel``, whose collectives rank 0 coordinates the others
  with); the transformer split with diffusers' own context parallelism over the mesh (Ulysses
  attention on CPU; ring or Ulysses + ring on GPUs);
* ``protocol``: what rank 0 sends the other ranks: the commands, and a round's payload;
* ``ulysses``: the all-to-all exchanges of Ulysses attention, for the families whose attention
  processors split the heads themselves;
* ``sync_group``: a rank's weight-sync group with a trainer, a process group of its own.

No other module of the server calls a collective. The mesh's names are the package's own
(``from rollout_server.parallel import SequenceParallel``); the other concerns are imported from
their modules.
"""

from rollout_server.parallel.mesh import (
    ATTENTION_SPLITS,
    MESH_DIMS,
    ForkedRank,
    ParallelDims,
    SequenceParallel,
    check_splittable,
    fork_ranks,
    plan,
    split_inputs,
    start,
)

__all__ = [
    "ATTENTION_SPLITS",
    "MESH_DIMS",
    "ForkedRank",
    "ParallelDims",
    "SequenceParallel",
    "check_splittable",
    "fork_ranks",
    "plan",
    "split_inputs",
    "start",
]
