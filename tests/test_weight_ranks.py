"""A weight update sent from rank 0 to the other sequence-parallel ranks over a real two-process gloo
group: every tensor arrives bitwise, whatever its dtype and shape (bfloat16, integers, booleans, a
scalar, an empty tensor), with the header's fields."""

import datetime
import io
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout.v1 import rollout_pb2
from rollout_server.parallel import ParallelDims, SequenceParallel
from rollout_server.parallel.protocol import UPDATE
from rollout_server.weights import ranks
from rollout_server.weights.update import WeightUpdate


def update() -> WeightUpdate:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "blocks.0.weight": torch.randn(64, 48, generator=generator).to(torch.bfloat16),
        "blocks.0.bias": torch.randn(48, generator=generator),
        "pos.ids": torch.arange(10, dtype=torch.int64).reshape(2, 5),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.5, dtype=torch.float16),
        "empty": torch.empty(0, 3),
    }
    return WeightUpdate(7, rollout_pb2.WEIGHTS_KIND_SUBSET, tensors, 0, target="transformer_2")


def run_rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    dims = ParallelDims(sp=2, world_size=2)
    group = SequenceParallel(dims, rank=rank, cpu_group=dist.group.WORLD, timeout_seconds=60)
    try:
        if rank == 0:
            ranks.send(group, update())
        else:
            command, payload = group.broadcast_command("")
            received = ranks.receive(group, payload)
            # As bytes: a tensor put on the queue is shared through this process, which may be gone
            # by the time the test reads it.
            saved = io.BytesIO()
            torch.save(received.tensors, saved)
            results.put((command, received.policy_version, received.kind, received.target, saved.getvalue()))
    finally:
        dist.destroy_process_group()


def test_rank_0_update_arrives_bitwise_on_the_other_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("forkserver")  # the test servers' fork server: its imports are done
    results = context.Queue()
    processes = [context.Process(target=run_rank, args=(rank, port, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    command, version, kind, target, saved = results.get(timeout=120)
    tensors = torch.load(io.BytesIO(saved), weights_only=True)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    sent = update()
    assert (command, version, kind, target) == (UPDATE, 7, sent.kind, "transformer_2")
    assert list(tensors) == list(sent.tensors)
    for name, tensor in sent.tensors.items():
        assert tensors[name].dtype == tensor.dtype and tensors[name].shape == tensor.shape, name
        assert torch.equal(tensors[name], tensor), name
