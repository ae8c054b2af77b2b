"""The model's weights in device memory, or released for a trainer colocated on the same devices
(sleep and wake).

``Weights.release`` takes every tensor of the pipeline's modules (the transformers, the text encoders,
the VAE: their parameters and buffers) off the device and frees what they held: on an accelerator
into a host copy, after which the allocator's cache is emptied; on a CPU, where a host copy would free
nothing, into a safetensors file in a private temporary folder, after which the C library is asked to
give its freed heap back to the system. Each tensor object stays where it is, holding an empty
tensor meanwhile, so whatever refers to it (PEFT's layers, the policy, diffusers' hooks) still does.
``Weights.restore`` reads the bytes back into fresh tensors on the device and compares each one's
checksum digest with the one taken when it was released: the exact bytes come back, or an error says
which tensor did not. A failure while releasing frees nothing; one while restoring leaves the weights
released, to be restored again.

This module knows nothing of rollouts or ranks: the engine releases only between rounds, with no
rollout running, and under sequence parallelism every rank releases its own copy
(``Engine.release_memory``).
"""

import ctypes
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rollout_core import checksum

log = logging.getLogger("rollout_server.residency")
_SPILL_NAME = "weights.safetensors"


@dataclass(frozen=True)
class Moved:
    """What one release or restore moved on this rank."""

    tensors: int
    bytes: int
    seconds: float


class Spill:
    """The released tensors' bytes, off the device: ``load`` gives them back on ``device``."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device):
        self.device = device
        self.folder: Path | None = None
        self.host: dict[str, torch.Tensor] = {}
        if device.type == "cpu":
            self.folder = Path(tempfile.mkdtemp(prefix="rollout-server-released-"))  # private: mode 0700
            try:
                save_file(tensors, self.folder / _SPILL_NAME)
            except BaseException:
                self.discard()
                raise
        else:
            self.host = {name: tensor.to("cpu") for name, tensor in tensors.items()}

    def load(self) -> dict[str, torch.Tensor]:
        if self.folder is None:
            return {name: tensor.to(self.device) for name, tensor in self.host.items()}
        # pread, not mmap: each tensor gets memory of its own, and nothing maps the file once read.
        return load_file(self.folder / _SPILL_NAME, device=str(self.device), backend="pread")

    def discard(self) -> None:
        self.host = {}
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


class Weights:
    """The tensors of ``modules`` (by pipeline component name) on ``device``, resident or released."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device):
        self.modules, self.device = modules, device
        self._released: dict[str, torch.Tensor] = {}  # the tensor objects emptied, by name
        self._spill: Spill | None = None
        self._digests: dict[str, str] = {}  # of the released bytes, by name
        self._bytes = 0

    @property
    def released(self) -> bool:
        return self._spill is not None

    def _live(self) -> dict[str, torch.Tensor]:
        """Every distinct parameter and buffer of the modules once, by "<component>/<name>" (taken at
        each release: a LoRA update adds and removes parameters). A tensor two modules share (tied
        embeddings) is released once, and shared again when restored."""
        tensors, seen = {}, set()
        for component, module in self.modules.items():
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    tensors[f"{component}/{name}"] = tensor
        return tensors

    def release(self) -> Moved:
        """Move the tensors off the device and free their memory (see the module docstring)."""
        started_at = time.perf_counter()
        tensors = self._live()
        contiguous = {name: tensor.detach().contiguous() for name, tensor in tensors.items()}
        digests = checksum.digest_lines(contiguous)
        spill = Spill(contiguous, self.device)  # nothing is freed if this fails
        del contiguous
        self._released, self._spill, self._digests = tensors, spill, digests
        self._bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        for tensor in tensors.values():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        _free_cached_memory(self.device)
        return self._moved("released", started_at)

    def restore(self) -> Moved:
        """Put the released tensors back on the device, the same bytes as they were released."""
        started_at = time.perf_counter()
        loaded = self._spill.load()
        lines = checksum.digest_lines(loaded)
        changed = sorted(name for name in self._digests if lines.get(name) != self._digests[name])
        if changed or lines.keys() != self._digests.keys():
            raise RuntimeError(
                f"the released weights did not come back as they were released ({len(changed)} tensors "
                f"differ, the first {changed[:1]}): they stay released"
            )
        for name, tensor in self._released.items():
            tensor.data = loaded[name]
        self._spill.discard()
        moved = self._moved("restored", started_at)
        self._released, self._spill, self._digests = {}, None, {}
        return moved

    def _moved(self, what: str, started_at: float) -> Moved:
        moved = Moved(len(self._released), self._bytes, time.perf_counter() - started_at)
        log.info("%s %d tensors (%d bytes) in %.3f s", what, moved.tensors, moved.bytes, moved.seconds)
        return moved

    def close(self) -> None:
        """Delete the released tensors' spill (the server stops)."""
        if self._spill is not None:
            self._spill.discard()


def _free_cached_memory(device: torch.device) -> None:
    """Hand what the freed tensors held back to the system: an accelerator's cached blocks, or on a CPU
    the heap glibc keeps for later allocations (tensors below its mmap threshold live there)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _GLIBC is not None:
        _GLIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not a glibc system (musl, macOS): freed heap is the C library's to keep
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_GLIBC = _glibc()
