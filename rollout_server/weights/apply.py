"""A checked update made the served weights, in place, restoring the previous ones if it fails."""

import warnings

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from rollout.v1 import rollout_pb2
from rollout_core.checksum import base_tensors
from rollout_server.weights.lora_config import parse_lora_config
from rollout_server.weights.update import DEFAULT_ADAPTER_NAME, FULL, LORA, WeightUpdate

# A new adapter is loaded next to the previous one, which is then deleted: that is intended here.
warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute in the model")


def peft_name(policy_version: int) -> str:
    """The adapter's name inside PEFT: unique per update, since a trainer may reuse its own name."""
    return f"policy_v{policy_version}"


def apply_update(
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
    name = peft_name(update.policy_version)
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
            transformer.set_adapter(peft_name(loaded.policy_version))
        raise
    if loaded is not None:
        transformer.delete_adapters(peft_name(loaded.policy_version))
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
