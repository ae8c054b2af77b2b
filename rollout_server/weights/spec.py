"""An update checked against the loaded transformer, without touching it.

Names, shapes and dtypes are compared with a ``TransformerSpec`` taken when the model was loaded (base
tensors never change shape), and a LoRA adapter is laid out on an empty copy of the transformer on the
meta device. So the service checks an update while rollouts run, and only the engine's worker touches
the model, between two rollouts.
"""

import copy
import functools
import math
import re
from dataclasses import dataclass

import numpy
import torch
from peft import get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer

from rollout_core.checksum import base_tensors
from rollout_server.errors import StaleUpdate
from rollout_server.limits import MAX_POLICY_VERSION
from rollout_server.quoting import quoted
from rollout_server.weights.lora_config import parse_lora_config
from rollout_server.weights.update import FULL, LORA, SUBSET, WeightUpdate, reject

# Room for the safetensors header on top of the tensor bytes (about 100 bytes per tensor).
HEADER_ALLOWANCE_BYTES = 16 * 1024 * 1024
BFLOAT16_EXPONENT = 0x7F80


def check_target(target: str, experts, field: str = "header.target") -> None:
    """InvalidRequest on ``field`` unless ``target`` names one of the server's transformers (checked
    before the name reaches a path or a lookup)."""
    if target not in experts:
        named = ", ".join(repr(name) for name in experts)
        raise reject(field, f"{quoted(target)} is not one of this model's transformers ({named})")


def check_version(new: int, current: int, field: str = "policy_version") -> None:
    """StaleUpdate unless ``new`` is above ``current`` (so 0 never is); InvalidRequest on ``field`` if
    it is above MAX_POLICY_VERSION, which would leave no room for later versions."""
    if new <= current:
        raise StaleUpdate(f"policy version {new} is not above the server's current version {current}")
    if new > MAX_POLICY_VERSION:
        raise reject(field, f"must be at most {MAX_POLICY_VERSION} (2^63 - 1), got {new}")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """InvalidRequest on ``data`` if a floating-point (CPU) tensor holds a NaN or an infinity.

    numpy, single-threaded and without a temporary: it runs on the event loop as each received tensor
    completes, where torch's thread pool would contend with gRPC's threads for the cores (measured: 3x
    slower on a loaded 2-core machine). min and max propagate NaN, and an infinity is an extreme;
    bfloat16, which numpy lacks, is checked on its exponent bits (all ones: inf or NaN)."""
    if not tensor.is_floating_point() or not tensor.numel():
        return
    if tensor.device.type != "cpu":  # received over NCCL: checked where it lies
        finite = bool(torch.isfinite(tensor).all())
    elif tensor.dtype == torch.bfloat16:
        bits = tensor.view(torch.int16).numpy()
        finite = not numpy.any((bits & BFLOAT16_EXPONENT) == BFLOAT16_EXPONENT)
    else:
        values = tensor.numpy()
        finite = math.isfinite(values.min()) and math.isfinite(values.max())
    if not finite:
        raise reject("data", f"tensor {quoted(name)} holds NaN or infinite values")


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
        return cls(
            tensors={name: (t.dtype, tuple(t.shape)) for name, t in live.items()},
            empty_model=empty,
            unwrappable=context_parallel_modules(transformer) if sequence_parallel else (),
        )

    @property
    def tensor_bytes(self) -> int:
        """The bytes of the transformer's tensors: a FULL update's payload."""
        return layout_bytes(self.tensors)

    @property
    def max_update_bytes(self) -> int:
        return self.tensor_bytes + HEADER_ALLOWANCE_BYTES


def layout_bytes(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """The bytes of the tensors a layout (name: dtype, shape) lists."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in layout.values())


def context_parallel_modules(transformer: torch.nn.Module) -> tuple[str, ...]:
    """The submodules the transformer's context-parallel plan hooks, by name; a plan's ``blocks.*``
    names every block of that list, as diffusers reads it (Qwen-Image's plan has one)."""
    plan = getattr(transformer, "_cp_plan", None) or {}
    names = re.compile("|".join(re.escape(name).replace(r"\*", r"\d+") for name in plan if name))
    return tuple(name for name, _ in transformer.named_modules() if name and names.fullmatch(name))


# A trainer sends the same config with every update; laying it out takes tens of milliseconds.
@functools.lru_cache(maxsize=8)
def lora_layout(spec: TransformerSpec, config_json: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors (name, dtype, shape) of an adapter with this config, exactly as PEFT lays it out
    on the transformer; InvalidRequest if the config does not fit it."""
    model = copy.deepcopy(spec.empty_model)
    try:
        inject_adapter_in_model(parse_lora_config(config_json), model, adapter_name="spec")
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        raise reject(
            "header.lora_config_json", f"the adapter does not fit the transformer: {error}"
        ) from error
    wrapped = [name for name in spec.unwrappable if isinstance(model.get_submodule(name), BaseTunerLayer)]
    if wrapped:
        raise reject(
            "header.lora_config_json",
            f"under sequence parallelism an adapter may not wrap {wrapped}: context parallelism "
            "gathers their outputs",
        )
    layout = get_peft_model_state_dict(model, adapter_name="spec")
    return {name: (t.dtype, tuple(t.shape)) for name, t in layout.items()}


def check(spec: TransformerSpec, update: WeightUpdate, header: str = "header", data: str = "data") -> None:
    """InvalidRequest naming what is wrong with ``update`` (the first bad tensor); changes nothing.
    ``header`` and ``data`` name the request's fields for the header and the tensors."""
    if update.kind not in (FULL, SUBSET, LORA):
        raise reject(f"{header}.kind", "must be WEIGHTS_KIND_FULL, WEIGHTS_KIND_SUBSET or WEIGHTS_KIND_LORA")
    if (update.kind == LORA) != bool(update.lora_config_json):
        raise reject(f"{header}.lora_config_json", "is required for LORA updates, and only for them")
    if update.kind != LORA and update.adapter_name:
        raise reject(f"{header}.adapter_name", "only LORA updates name an adapter")
    if len(update.adapter_name) > 128 or not update.adapter_name.isprintable():
        raise reject(f"{header}.adapter_name", "must be printable and at most 128 characters")
    if not update.tensors:
        raise reject(data, "the update holds no tensors")
    adapter = update.kind == LORA
    expected = lora_layout(spec, update.lora_config_json) if adapter else spec.tensors
    what = "the adapter" if adapter else "the transformer"
    for name, tensor in update.tensors.items():
        if name not in expected:
            raise reject(data, f"unknown tensor {quoted(name)}: {what} has no tensor of that name")
        dtype, shape = expected[name]
        if tensor.dtype != dtype:
            raise reject(data, f"tensor {quoted(name)} is {tensor.dtype}; {what} holds it as {dtype}")
        if tuple(tensor.shape) != shape:
            raise reject(
                data, f"tensor {quoted(name)} has shape {list(tensor.shape)}; {what}'s is {list(shape)}"
            )
    missing = [name for name in expected if name not in update.tensors]
    if missing and update.kind != SUBSET:
        raise reject(
            data,
            f"{len(missing)} of {what}'s tensors are missing, e.g. {missing[:3]} (use SUBSET for a part)",
        )
