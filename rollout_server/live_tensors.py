"""What a piece of work holds in tensors, counted op by op as it runs (on any device, the meta device
included: only sizes are read).

``LiveTensorBytes`` sees every tensor that an op makes. A storage counts from the op that makes it
until no tensor on it (its views included) is left; views of tensors made before are not counted,
nor is a kernel's own scratch unless the caller reports it (``scratch``). Two figures come of it:

- ``peak``, the most bytes alive at once: what an allocator that reuses a freed block for any request
  that fits in it needs at least;
- ``by_size``, the most blocks of each size alive at once, whose sum (``segregated``) is the most an
  allocator holds that reuses a freed block for a request of the same size. The memory estimate
  takes it for what glibc's malloc, the CPU's, keeps: it serves a request from the smallest free
  chunk it fits in (one of its own size first) and keeps the chunks freed below its mmap threshold
  for later requests, so as a decoder's tensors grow from stage to stage, what the earlier stages
  freed stays in its heap beside what the later ones hold (docs/benchmarks.md measures the resident
  set against it).
"""

import weakref
from collections import Counter

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveTensorBytes(TorchDispatchMode):
    """The tensors made by the ops run under it; see the module's docstring. ``start_piece`` begins
    the figures of a new piece of work from what is alive now."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.by_size: Counter[int] = Counter()  # storage bytes: the most storages of them alive at once
        self._alive: Counter[int] = Counter()  # storage bytes: storages of them alive now
        self._storages: dict[int, list[int]] = {}  # storage: [tensors on it, its bytes]

    @property
    def segregated(self) -> int:
        """The bytes of ``by_size``: each size's most blocks alive at once."""
        return sum(size * count for size, count in self.by_size.items())

    def start_piece(self) -> None:
        """Begin the figures anew from the tensors alive now (what earlier work left)."""
        self.peak = self.live
        self.by_size = Counter(self._alive)

    def scratch(self, size: int) -> None:
        """Count a block of ``size`` bytes that a kernel takes and frees while the tensors alive now
        stay alive (the columns a convolution unfolds its input into)."""
        self.peak = max(self.peak, self.live + size)
        self.by_size[size] = max(self.by_size[size], self._alive[size] + 1)

    def _made(self, key: int, size: int) -> None:
        self._storages[key] = [0, size]
        self.live += size
        self._alive[size] += 1
        self.by_size[size] = max(self.by_size[size], self._alive[size])
        self.peak = max(self.peak, self.live)

    def _released(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            self._alive[entry[1]] -= 1
            del self._storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        before = {t.untyped_storage()._cdata for t in inputs} - set(self._storages)
        for tensor in pytree.tree_leaves(output):
            if not isinstance(tensor, torch.Tensor) or any(tensor is t for t in inputs):
                continue  # an in-place op's
            storage = tensor.untyped_storage()
            key = storage._cdata  # the storage itself: a meta tensor has no address
            if key in before:
                continue  # a view of a tensor made before
            if key not in self._storages:
                self._made(key, storage.nbytes())
            self._storages[key][0] += 1
            weakref.finalize(tensor, self._released, key)
        return output
