"""``WeightsUpdate``: one policy update as a trainer pushes it, and the header that describes it on the
wire. ``RolloutClient``, ``RolloutPool`` and ``WeightSyncGroup`` each ``push`` one; their
``update_weights(weights, version, ...)`` is ``from_weights(push)``, written once here."""

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from rollout.v1 import rollout_pb2

WEIGHTS_KINDS = {
    "full": rollout_pb2.WEIGHTS_KIND_FULL,
    "subset": rollout_pb2.WEIGHTS_KIND_SUBSET,
    "lora": rollout_pb2.WEIGHTS_KIND_LORA,
}
Answer = TypeVar("Answer")


def lora_config_json(config: Any) -> str:
    """A peft ``LoraConfig`` (or its dict) as the JSON an update's header carries (sets as lists)."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)

    def listed(value: Any) -> list:
        if isinstance(value, set | frozenset):
            return sorted(value)
        raise TypeError(f"{type(value).__name__} in a LoraConfig is not JSON serialisable")

    return json.dumps(values, default=listed)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value
class WeightsUpdate:
    """New policy weights, and what they replace.

    ``weights`` is the transformer's state dict (kind "full"), some of its tensors ("subset"), or a
    PEFT LoRA adapter, ``peft.get_peft_model_state_dict(transformer)``, with its ``lora_config``
    (kind "lora", the default when a config is given); ``adapter_name`` names that adapter. Tensors
    must have the server model's dtypes. ``version`` must be above the server's policy version:
    rollouts that start after the update applied report it. ``target`` names the transformer it
    changes when the model has several (Wan 2.2: "transformer_2" for the low-noise expert;
    GetServerInfo lists them).
    """

    weights: Mapping[str, torch.Tensor]
    version: int
    kind: str | None = None
    lora_config: Any = None
    adapter_name: str = ""
    target: str = ""

    @property
    def resolved_kind(self) -> str:
        """The kind, "full", "subset" or "lora": ``kind`` as given, else "lora" with a LoRA config and
        "full" without."""
        return self.kind or ("lora" if self.lora_config is not None else "full")

    def header(self) -> rollout_pb2.WeightsUpdateHeader:
        """The header of the update (UpdateWeights, or a group update's manifest), without its size."""
        return rollout_pb2.WeightsUpdateHeader(
            policy_version=self.version,
            kind=WEIGHTS_KINDS[self.resolved_kind],
            lora_config_json=lora_config_json(self.lora_config) if self.lora_config is not None else "",
            adapter_name=self.adapter_name,
            target=self.target,
        )

    def snapshot(self) -> "WeightsUpdate":
        """The update with an in-host copy of its tensors: what a pool keeps to replay later, whatever
        the trainer does with its own tensors meanwhile."""
        copies = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.weights.items()}
        return dataclasses.replace(self, weights=copies)


UPDATE_FIELDS = frozenset(field.name for field in dataclasses.fields(WeightsUpdate))


def from_weights(push: Callable[..., Answer]) -> Callable[..., Answer]:
    """The ``update_weights(weights, version, *fields, **options)`` form of a method
    ``push(update, **options)``: the arguments of WeightsUpdate (``kind``, ``lora_config``,
    ``adapter_name``, ``target``, in that order or by name) build the update, and every other keyword
    goes to ``push`` (e.g. ``progress``)."""

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int, *fields: Any, **options: Any):
        named = {name: options.pop(name) for name in UPDATE_FIELDS & options.keys()}
        return push(self, WeightsUpdate(weights, version, *fields, **named), **options)

    update_weights.__doc__ = (
        f"``{push.__name__}(WeightsUpdate(weights, version, *fields, ...), **options)``: WeightsUpdate "
        f"says what its arguments mean, ``{push.__name__}`` the options and the answer."
    )
    update_weights.__annotations__["return"] = push.__annotations__["return"]
    return update_weights
