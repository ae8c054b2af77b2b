"""Policy weight updates: check an update against the loaded transformer, then apply it in place.

An update is one of three kinds (rollout.v1 ``WeightsKind``):

* FULL: every tensor of the transformer's state dict, under its plain (checkpoint) name; the
  received tensors become the parameters' data (no copy; the old data is kept only until the update
  is complete, to restore it if a step fails); a loaded LoRA adapter is removed.
* SUBSET: some of those tensors, replaced the same way; the rest and any adapter stay.
* LORA: a PEFT LoRA adapter (``peft.get_peft_model_state_dict`` names) and its ``LoraConfig``, loaded
  through diffusers' PEFT integration on top of the base weights; it replaces the previous adapter.

Checking an update needs no access to the live model: names, shapes and dtypes are compared with a
``TransformerSpec`` taken when the model was loaded (base tensors never change shape), and a LoRA
adapter is laid out on an empty copy of the transformer on the meta device. So the service checks an
update while rollouts run, and only the engine's worker touches the model, between two rollouts.
"""

import asyncio
import copy
import functools
import math
import struct
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
from peft import get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.lora import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import SafetensorError
from safetensors.torch import load_file

from rollout.v1 import rollout_pb2
from rollout_core import codec
from rollout_server.limits import MAX_POLICY_VERSION
from rollout_server.lora_config import parse_lora_config
from rollout_server.upload import MalformedBuffer, TensorAssembler, UpdateMessage, assemble
from rollout_server.validation import InvalidRequest, quoted

FULL, SUBSET, LORA = (
    rollout_pb2.WEIGHTS_KIND_FULL,
    rollout_pb2.WEIGHTS_KIND_SUBSET,
    rollout_pb2.WEIGHTS_KIND_LORA,
)
DEFAULT_ADAPTER_NAME = "default"
# Room for the safetensors header on top of the tensor bytes (about 100 bytes per tensor).
HEADER_ALLOWANCE_BYTES = 16 * 1024 * 1024
# LoadWeights paths: checked before the filesystem sees them (Linux PATH_MAX and NAME_MAX).
MAX_PATH_CHARS = 4096
MAX_PATH_PART_BYTES = 255
BFLOAT16_EXPONENT = 0x7F80
PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PeftModel.save_pretrained prefixes the names it saves with this.
PEFT_SAVED_PREFIX = "base_model.model."
# A new adapter is loaded next to the previous one, which is then deleted: that is intended here.
warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute in the model")


class StaleUpdate(Exception):
    """The update's policy version is not above the server's current one."""


class UploadIdle(Exception):
    """The client sent nothing for longer than the server's upload idle timeout."""


@dataclass(frozen=True)
class WeightUpdate:
    """A received or loaded update, not yet checked."""

    policy_version: int
    kind: int  # rollout_pb2.WeightsKind
    tensors: dict[str, torch.Tensor]
    nbytes: int
    lora_config_json: str = ""
    adapter_name: str = ""
    target: str = "transformer"  # the pipeline component it changes

    def describe(self) -> str:
        kind = rollout_pb2.WeightsKind.Name(self.kind) if self.kind in (FULL, SUBSET, LORA) else self.kind
        of = "" if self.target == "transformer" else f" of {self.target}"
        return f"policy version {self.policy_version} ({kind}{of}, {len(self.tensors)} tensors)"


def _reject(field: str, description: str) -> InvalidRequest:
    return InvalidRequest([(field, description)])


def check_target(target: str, experts, field: str = "header.target") -> None:
    """InvalidRequest on ``field`` unless ``target`` names one of the server's transformers (checked
    before the name reaches a path or a lookup)."""
    if target not in experts:
        named = ", ".join(repr(name) for name in experts)
        raise _reject(field, f"{quoted(target)} is not one of this model's transformers ({named})")


def check_version(new: int, current: int, field: str = "policy_version") -> None:
    """StaleUpdate unless ``new`` is above ``current`` (so 0 never is); InvalidRequest on ``field`` if
    it is above MAX_POLICY_VERSION, which would leave no room for later versions."""
    if new <= current:
        raise StaleUpdate(f"policy version {new} is not above the server's current version {current}")
    if new > MAX_POLICY_VERSION:
        raise _reject(field, f"must be at most {MAX_POLICY_VERSION} (2^63 - 1), got {new}")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """InvalidRequest on ``data`` if a floating-point (CPU) tensor holds a NaN or an infinity.

    numpy, single-threaded and without a temporary: it runs on the event loop as each received tensor
    completes, where torch's thread pool would contend with gRPC's threads for the cores (measured: 3x
    slower on a loaded 2-core machine). min and max propagate NaN, and an infinity is an extreme;
    bfloat16, which numpy lacks, is checked on its exponent bits (all ones: inf or NaN)."""
    if not tensor.is_floating_point() or not tensor.numel():
        return
    if tensor.dtype == torch.bfloat16:
        bits = tensor.view(torch.int16).numpy()
        finite = not numpy.any((bits & BFLOAT16_EXPONENT) == BFLOAT16_EXPONENT)
    else:
        values = tensor.numpy()
        finite = math.isfinite(values.min()) and math.isfinite(values.max())
    if not finite:
        raise _reject("data", f"tensor {quoted(name)} holds NaN or infinite values")


def base_tensors(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's own parameters and buffers under their checkpoint names, looking through the
    LoRA layers PEFT wraps around adapted modules (``x.base_layer.weight`` is ``x.weight``)."""
    return {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in transformer.state_dict(keep_vars=True).items()
        if f".{LoraModel.prefix}" not in name
    }


@dataclass(frozen=True, eq=False)  # hashed by identity: it keys the LoRA layout cache
class TransformerSpec:
    """What updates are checked against, taken once when the model is loaded."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    empty_model: torch.nn.Module  # the transformer's architecture on the meta device, no adapter
    # Modules with sequence-parallel hooks (e.g. the output gather): a LoRA layer around one would add
    # its unsplit base output to a split adapter output.
    unwrappable: tuple[str, ...]

    @classmethod
    def of(cls, transformer: torch.nn.Module, sequence_parallel: bool) -> "TransformerSpec":
        live = base_tensors(transformer)
        with torch.device("meta"):
            empty = type(transformer).from_config(transformer.config)
        for name, tensor in empty.state_dict(keep_vars=True).items():
            tensor.data = tensor.data.to(live[name].dtype)  # PEFT gives an adapter its base's dtype
        hooked = [name for name in getattr(transformer, "_cp_plan", None) or {} if name]
        return cls(
            tensors={name: (t.dtype, tuple(t.shape)) for name, t in live.items()},
            empty_model=empty,
            unwrappable=tuple(hooked) if sequence_parallel else (),
        )

    @property
    def max_update_bytes(self) -> int:
        tensor_bytes = sum(math.prod(shape) * dtype.itemsize for dtype, shape in self.tensors.values())
        return tensor_bytes + HEADER_ALLOWANCE_BYTES


# A trainer sends the same config with every update; laying it out takes tens of milliseconds.
@functools.lru_cache(maxsize=8)
def lora_layout(spec: TransformerSpec, config_json: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors (name, dtype, shape) of an adapter with this config, exactly as PEFT lays it out
    on the transformer; InvalidRequest if the config does not fit it."""
    model = copy.deepcopy(spec.empty_model)
    try:
        inject_adapter_in_model(parse_lora_config(config_json), model, adapter_name="spec")
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        raise _reject(
            "header.lora_config_json", f"the adapter does not fit the transformer: {error}"
        ) from error
    wrapped = [name for name in spec.unwrappable if isinstance(model.get_submodule(name), BaseTunerLayer)]
    if wrapped:
        raise _reject(
            "header.lora_config_json",
            f"under sequence parallelism an adapter may not wrap {wrapped}: context parallelism "
            "gathers their outputs",
        )
    layout = get_peft_model_state_dict(model, adapter_name="spec")
    return {name: (t.dtype, tuple(t.shape)) for name, t in layout.items()}


def check(spec: TransformerSpec, update: WeightUpdate) -> None:
    """InvalidRequest naming what is wrong with ``update`` (the first bad tensor); changes nothing."""
    if update.kind not in (FULL, SUBSET, LORA):
        raise _reject("header.kind", "must be WEIGHTS_KIND_FULL, WEIGHTS_KIND_SUBSET or WEIGHTS_KIND_LORA")
    if (update.kind == LORA) != bool(update.lora_config_json):
        raise _reject("header.lora_config_json", "is required for LORA updates, and only for them")
    if update.kind != LORA and update.adapter_name:
        raise _reject("header.adapter_name", "only LORA updates name an adapter")
    if len(update.adapter_name) > 128 or not update.adapter_name.isprintable():
        raise _reject("header.adapter_name", "must be printable and at most 128 characters")
    if not update.tensors:
        raise _reject("data", "the update holds no tensors")
    adapter = update.kind == LORA
    expected = lora_layout(spec, update.lora_config_json) if adapter else spec.tensors
    what = "the adapter" if adapter else "the transformer"
    for name, tensor in update.tensors.items():
        if name not in expected:
            raise _reject("data", f"unknown tensor {quoted(name)}: {what} has no tensor of that name")
        dtype, shape = expected[name]
        if tensor.dtype != dtype:
            raise _reject("data", f"tensor {quoted(name)} is {tensor.dtype}; {what} holds it as {dtype}")
        if tuple(tensor.shape) != shape:
            raise _reject(
                "data", f"tensor {quoted(name)} has shape {list(tensor.shape)}; {what}'s is {list(shape)}"
            )
    missing = [name for name in expected if name not in update.tensors]
    if missing and update.kind != SUBSET:
        raise _reject(
            "data",
            f"{len(missing)} of {what}'s tensors are missing, e.g. {missing[:3]} (use SUBSET for a part)",
        )


def _peft_name(policy_version: int) -> str:
    """The adapter's name inside PEFT: unique per update, since a trainer may reuse its own name."""
    return f"policy_v{policy_version}"


def apply(
    transformer: torch.nn.Module, update: WeightUpdate, loaded: rollout_pb2.LoraAdapter | None
) -> rollout_pb2.LoraAdapter | None:
    """Apply a checked update; returns the LoRA adapter loaded afterwards, if any. If it fails
    part-way, the previous weights and adapter are restored before the error propagates."""
    if update.kind == LORA:
        return _load_lora(transformer, update, loaded)
    live = base_tensors(transformer)
    replaced: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, tensor in update.tensors.items():
                replaced[name] = _replace(live[name], tensor)
            if update.kind == FULL and loaded is not None:
                transformer.unload_lora()  # the pushed tensors are the whole policy
                return None
    except BaseException:
        with torch.no_grad():
            for name, previous in replaced.items():
                _replace(live[name], previous)
        raise
    return loaded


def _replace(target: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Make ``new`` the value of ``target`` and return the previous value, to restore it with.

    On the model's device the received tensor (which owns its memory) becomes the parameter's data and
    the old data is kept: no copy, no extra memory beyond the update itself, which is already held. On
    another device (an accelerator) the values are copied in, after a host copy of the old ones: the
    update's size in host memory, none on the device."""
    if new.device == target.device:
        previous = target.data
        target.data = new
        return previous
    previous = target.detach().to("cpu", copy=True)
    target.copy_(new)
    return previous


def _load_lora(
    transformer: torch.nn.Module, update: WeightUpdate, loaded: rollout_pb2.LoraAdapter | None
) -> rollout_pb2.LoraAdapter:
    config = parse_lora_config(update.lora_config_json)
    name = _peft_name(update.policy_version)
    # Sorted, so the first name is a lora_A one: diffusers takes anything else for a non-PEFT format.
    tensors = dict(sorted(update.tensors.items()))
    try:
        transformer.load_lora_adapter(tensors, prefix=None, adapter_name=name, metadata=config.to_dict())
        transformer.set_adapter(name)
    except BaseException:
        # Drop what was loaded of the new adapter; the previous one (or none) stays in force.
        if name in getattr(transformer, "peft_config", {}):
            transformer.delete_adapters(name)
        if loaded is not None:
            transformer.set_adapter(_peft_name(loaded.policy_version))
        raise
    if loaded is not None:
        transformer.delete_adapters(_peft_name(loaded.policy_version))
    return rollout_pb2.LoraAdapter(
        name=update.adapter_name or DEFAULT_ADAPTER_NAME,
        rank=config.r,
        alpha=config.lora_alpha,
        target_modules=sorted(config.target_modules),
        tensors=len(update.tensors),
        policy_version=update.policy_version,
        modules=adapter_modules(transformer, name),
    )


def adapter_modules(transformer: torch.nn.Module, peft_name: str) -> list[str]:
    """The modules the LoRA adapter ``peft_name`` is attached to, as they stand after loading."""
    return sorted(
        name
        for name, module in transformer.named_modules()
        if isinstance(module, BaseTunerLayer) and peft_name in getattr(module, "lora_A", {})
    )


async def receive(
    requests: AsyncIterator[UpdateMessage],
    current_version: Callable[[], int],
    max_bytes: int,
    idle_seconds: float,
) -> WeightUpdate:
    """Reassemble an UpdateWeights stream into one update, each tensor built and checked for finite
    values as its bytes arrive. A stale version is refused before any data is read; a stream silent for
    ``idle_seconds`` ends with UploadIdle."""
    header, assembler = None, None
    loop = asyncio.get_running_loop()
    try:
        # One deadline, moved on at every message (no timer task per message).
        async with asyncio.timeout(idle_seconds) as idle:
            async for message in requests:
                idle.reschedule(loop.time() + idle_seconds)
                if header is None:
                    header = _first_header(message, current_version(), max_bytes)
                    assembler = TensorAssembler(header.total_bytes, HEADER_ALLOWANCE_BYTES, check_finite)
                elif message.header is not None:
                    raise _reject("header", "only the first message carries a header")
                try:
                    assembler.feed(message.data)
                except MalformedBuffer as error:
                    raise _reject("data", str(error)) from error
    except TimeoutError as error:
        raise UploadIdle(f"no update message for {idle_seconds:g} s: the upload was dropped") from error
    if header is None:
        raise _reject("header", "the stream was empty")
    try:
        tensors = assembler.result()
    except MalformedBuffer as error:
        raise _reject("data", str(error)) from error
    return _from_header(header, tensors, header.total_bytes)


def _first_header(
    message: UpdateMessage, current_version: int, max_bytes: int
) -> rollout_pb2.WeightsUpdateHeader:
    """The checked header of an update stream's first message."""
    if message.header is None:
        raise _reject("header", "the first message must carry the header")
    header = message.header
    check_version(header.policy_version, current_version, "header.policy_version")
    if not 0 < header.total_bytes <= max_bytes:
        raise _reject("header.total_bytes", f"must be in [1, {max_bytes}], got {header.total_bytes}")
    return header


def _from_header(
    header: rollout_pb2.WeightsUpdateHeader, tensors: dict[str, torch.Tensor], nbytes: int
) -> WeightUpdate:
    return WeightUpdate(
        policy_version=header.policy_version,
        kind=header.kind,
        tensors=tensors,
        nbytes=nbytes,
        lora_config_json=header.lora_config_json,
        adapter_name=header.adapter_name,
        target=header.target or "transformer",
    )


def to_payload(update: WeightUpdate) -> bytes:
    """The update as one bytes object, for rank 0 to broadcast: header length, header, safetensors."""
    header = rollout_pb2.WeightsUpdateHeader(
        policy_version=update.policy_version,
        kind=update.kind,
        lora_config_json=update.lora_config_json,
        adapter_name=update.adapter_name,
        target=update.target,
    ).SerializeToString()
    _, buffer = codec.encode(update.tensors)
    return struct.pack("<Q", len(header)) + header + buffer


def from_payload(payload: bytes) -> WeightUpdate:
    """The update rank 0 broadcast (it checked the values): every tensor in its own memory."""
    (size,) = struct.unpack("<Q", payload[:8])
    header = rollout_pb2.WeightsUpdateHeader.FromString(payload[8 : 8 + size])
    data = memoryview(payload)[8 + size :]
    return _from_header(header, assemble(data, HEADER_ALLOWANCE_BYTES, lambda name, tensor: None), len(data))


def check_path(requested: str) -> None:
    """InvalidRequest on ``path`` unless the filesystem can take ``requested`` as a path at all."""
    if "\0" in requested:
        raise _reject("path", "must not contain a NUL character")
    if len(requested) > MAX_PATH_CHARS:
        raise _reject("path", f"is {len(requested)} characters; at most {MAX_PATH_CHARS}")
    for part in Path(requested).parts:
        if len(part.encode(errors="surrogatepass")) > MAX_PATH_PART_BYTES:
            raise _reject("path", f"the name {quoted(part)} is longer than {MAX_PATH_PART_BYTES} bytes")


def resolve_under(root: Path, requested: str) -> Path:
    """``requested`` (relative to ``root``, or absolute) with '..' and symbolic links resolved:
    PermissionError unless it lies inside ``root`` (itself resolved), FileNotFoundError if absent."""
    check_path(requested)
    try:
        path = (root / requested).resolve()
    except RuntimeError as error:  # Python 3.11 reports a symbolic link loop this way
        raise _reject("path", f"{quoted(requested)} is a symbolic link loop") from error
    if not path.is_relative_to(root):
        raise PermissionError(f"{quoted(requested)} is outside the server's --weights-root")
    if not path.exists():
        raise FileNotFoundError(f"{quoted(requested)} does not exist under the server's --weights-root")
    return path


def read_update(
    root: Path, request: rollout_pb2.LoadWeightsRequest, current_version: int, max_bytes: int, experts
) -> WeightUpdate:
    """The update stored at ``request.path`` under ``root``: a PEFT adapter folder (LORA), or the
    safetensors weights of a file, a diffusers model folder or a pipeline folder's ``target``. A
    stale version, or files of more than ``max_bytes`` in all, are refused before anything is read;
    non-finite values once read."""
    check_target(request.target or "transformer", experts, "target")
    check_version(request.policy_version, current_version, "policy_version")
    path = resolve_under(root, request.path)
    try:
        is_adapter = (path / PEFT_CONFIG_FILE).is_file()
        kind = request.kind or (LORA if is_adapter else FULL)
        if (kind == LORA) != is_adapter:
            raise _reject(
                "kind", f"{quoted(request.path)} {'is' if is_adapter else 'is not'} a PEFT adapter folder"
            )
        if is_adapter:
            _check_size([path / PEFT_CONFIG_FILE, path / PEFT_WEIGHTS_FILE], max_bytes)
            config_json = (path / PEFT_CONFIG_FILE).read_text()
            tensors = {
                n.removeprefix(PEFT_SAVED_PREFIX): t for n, t in load_file(path / PEFT_WEIGHTS_FILE).items()
            }
        else:
            config_json, tensors = "", {}
            for file in _check_size(_weight_files(path, request.target or "transformer"), max_bytes):
                tensors.update(load_file(file))
    except (OSError, SafetensorError, UnicodeDecodeError) as error:
        raise _reject("path", f"cannot read the weights: {quoted(str(error))}") from error
    for name, tensor in tensors.items():
        check_finite(name, tensor)
    return WeightUpdate(
        policy_version=request.policy_version,
        kind=kind,
        tensors=tensors,
        nbytes=sum(t.nbytes for t in tensors.values()),
        lora_config_json=config_json,
        adapter_name=request.adapter_name,
        target=request.target or "transformer",
    )


def _check_size(files: list[Path], max_bytes: int) -> list[Path]:
    """``files``, unless together they are larger than an update may be (InvalidRequest on ``path``)."""
    size = sum(file.stat().st_size for file in files)
    if size > max_bytes:
        raise _reject("path", f"the weights there are {size} bytes; an update is at most {max_bytes}")
    return files


def _weight_files(path: Path, target: str) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise _reject("path", f"{quoted(path.name)} is not a .safetensors file")
        return [path]
    if (path / "model_index.json").is_file():  # a pipeline: the targeted transformer is the policy
        path = path / target
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _reject("path", "no .safetensors weights there")
    return files
