"""The weights checksum: one string for a set of named tensors, from their bytes alone.

A server reports the checksum of the policy it serves (GetServerInfo ``weights_checksum``, and every
weight update's answer); a trainer computes the same over its own weights and compares. The rule:

* each tensor's bytes (contiguous, little-endian, zero-padded to a multiple of 4) are read as int32
  words ``w_0 .. w_{n-1}``, and give the two sums, modulo the prime ``M = 2^61 - 1``::

      A = sum_i w_i                      B = sum_i (i + 1) * w_i

  (B changes when words move, A does not: together they catch changed and reordered values);
* the checksum is ``"w1:"`` and the first 32 hex digits of the SHA-256 of the lines
  ``"<name>\\t<dtype>\\t<shape>\\t<A>\\t<B>\\n"`` of every tensor, sorted by name (dtype as safetensors
  names it, shape as a list).

The sums are exact integer arithmetic (rows of ``2^15`` words summed in int64, which cannot
overflow, combined in Python integers; numpy on the CPU, torch on the tensor's own device
elsewhere), so equal bytes give an equal checksum on any device, and computing it is one pass over
the weights.
"""

import hashlib
from collections.abc import Mapping

import numpy
import torch

from rollout_core.dtypes import SAFETENSORS_NAMES

PREFIX = "w1:"
MODULUS = 2**61 - 1
ROW_WORDS = 2**15  # |sum (j + 1) * w_j| over a row < 2^15 * 2^15 * 2^31 = 2^61: no int64 overflow
ROWS_AT_ONCE = 16  # 512K words: an int64 block of 4 MiB, which stays in cache
LORA_PREFIX = "lora_"  # PEFT's LoRA tensors (peft.tuners.lora.LoraModel.prefix)


def tensor_digest(tensor: torch.Tensor) -> tuple[int, int]:
    """(A, B) of one tensor's bytes, as the module docstring defines them."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = data.numel() // 4 * 4
    words = data[:whole].clone() if data.storage_offset() % 4 else data[:whole]
    words = words.view(torch.int32)
    full_rows = words.numel() // ROW_WORDS
    row_sums = _cpu_row_sums if words.device.type == "cpu" else _device_row_sums
    total = weighted = 0
    for first, sums, ramped in row_sums(words, full_rows):
        for r, (a, b) in enumerate(zip(sums, ramped, strict=True)):
            total += a
            weighted += b + (first + r) * ROW_WORDS * a  # row r's words sit at r * ROW_WORDS + j
    tail = words[full_rows * ROW_WORDS :].to(torch.int64)
    if tail.numel():
        ramp = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=tail.device)
        tail_sum = int(tail.sum())
        total += tail_sum
        weighted += int((tail * ramp).sum()) + full_rows * ROW_WORDS * tail_sum
    if data.numel() > whole:  # the last 1-3 bytes, zero-padded to one word
        last = int.from_bytes(bytes(data[whole:].tolist()) + bytes(4 - (data.numel() - whole)), "little")
        last -= (last >> 31) << 32  # as int32
        total += last
        weighted += (words.numel() + 1) * last
    return total % MODULUS, weighted % MODULUS


def _cpu_row_sums(words: torch.Tensor, full_rows: int):
    """(first row, each row's sum, each row's (j + 1)-weighted sum) per block of rows, in numpy:
    single-threaded, so a server does not contend with its own threads (and faster here than
    torch's threads on these sizes); integer sums and products, exact."""
    values = words.numpy()
    ramp = numpy.arange(1, ROW_WORDS + 1, dtype=numpy.int64)
    wide = numpy.empty((min(ROWS_AT_ONCE, full_rows), ROW_WORDS), dtype=numpy.int64)  # reused
    for first in range(0, full_rows, ROWS_AT_ONCE):
        rows = min(ROWS_AT_ONCE, full_rows - first)
        block = values[first * ROW_WORDS : (first + rows) * ROW_WORDS].reshape(rows, ROW_WORDS)
        numpy.copyto(wide[:rows], block)
        yield first, block.sum(axis=1, dtype=numpy.int64).tolist(), (wide[:rows] @ ramp).tolist()


def _device_row_sums(words: torch.Tensor, full_rows: int):
    """The same on an accelerator, in torch."""
    ramp = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=words.device)
    for first in range(0, full_rows, ROWS_AT_ONCE):
        rows = min(ROWS_AT_ONCE, full_rows - first)
        block = words[first * ROW_WORDS : (first + rows) * ROW_WORDS].view(rows, ROW_WORDS).to(torch.int64)
        yield first, block.sum(1).tolist(), (block * ramp).sum(1).tolist()


def digest_line(name: str, tensor: torch.Tensor) -> str:
    """The checksum's line for one tensor."""
    a, b = tensor_digest(tensor)
    return f"{name}\t{SAFETENSORS_NAMES[tensor.dtype]}\t{list(tensor.shape)}\t{a}\t{b}\n"


def digest_lines(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The checksum's lines of ``tensors``, by name."""
    return {name: digest_line(name, tensor) for name, tensor in tensors.items()}


def combine(lines: Mapping[str, str]) -> str:
    """The checksum of tensors whose digest lines are ``lines`` (by name)."""
    hashed = hashlib.sha256("".join(lines[name] for name in sorted(lines)).encode())
    return PREFIX + hashed.hexdigest()[:32]


def weights_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """The checksum of ``tensors`` (name -> tensor, on any device)."""
    return combine(digest_lines(tensors))


def tensor_sha256(tensor: torch.Tensor) -> str:
    """One tensor's SHA-256 as SGLang-Diffusion's ``update_weights_from_tensor_checker`` computes it
    (``compute_tensor_sha256``): the hex digest of the dtype as torch prints it (``"torch.float32"``),
    the shape as a Python tuple prints it (``"(3, 4)"``), then the tensor's bytes (contiguous, as the
    host holds them), fed in that order."""
    tensor = tensor.detach().to("cpu").contiguous()
    hashed = hashlib.sha256(str(tensor.dtype).encode())
    hashed.update(repr(tuple(tensor.shape)).encode())
    hashed.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return hashed.hexdigest()


def base_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformer's own parameters and buffers under their checkpoint names, looking through the
    LoRA layers PEFT wraps around adapted modules (``x.base_layer.weight`` is ``x.weight``; the
    ``lora_`` tensors are left out)."""
    return {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in module.state_dict(keep_vars=True).items()
        if f".{LORA_PREFIX}" not in name
    }


def policy_tensors(
    transformers: Mapping[str, Mapping[str, torch.Tensor]],
    adapters: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors a server's ``weights_checksum`` covers, under the names it gives them: each
    transformer's base tensors (plain checkpoint names) as ``<component>/<name>``, and each loaded
    LoRA adapter's (``peft.get_peft_model_state_dict`` names) as ``<component>/lora/<name>``.

    >>> weights_checksum(policy_tensors({"transformer": base_tensors(transformer)}))
    """
    named = {
        f"{component}/{name}": t for component, tensors in transformers.items() for name, t in tensors.items()
    }
    for component, tensors in (adapters or {}).items():
        named.update({f"{component}/lora/{name}": t for name, t in tensors.items()})
    return named
