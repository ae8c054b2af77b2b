"""The weight update record: what was received or read, before it is checked."""

from dataclasses import dataclass

import torch

from rollout.v1 import rollout_pb2
from rollout_server.errors import InvalidRequest

FULL, SUBSET, LORA = (
    rollout_pb2.WEIGHTS_KIND_FULL,
    rollout_pb2.WEIGHTS_KIND_SUBSET,
    rollout_pb2.WEIGHTS_KIND_LORA,
)
DEFAULT_ADAPTER_NAME = "default"


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


def reject(field: str, description: str) -> InvalidRequest:
    return InvalidRequest([(field, description)])


def from_header(
    header: rollout_pb2.WeightsUpdateHeader, tensors: dict[str, torch.Tensor], nbytes: int
) -> WeightUpdate:
    """The update a header describes, holding ``tensors``."""
    return WeightUpdate(
        policy_version=header.policy_version,
        kind=header.kind,
        tensors=tensors,
        nbytes=nbytes,
        lora_config_json=header.lora_config_json,
        adapter_name=header.adapter_name,
        target=header.target or "transformer",
    )


def header_of(update: WeightUpdate) -> rollout_pb2.WeightsUpdateHeader:
    """The header that describes ``update`` (its tensors aside)."""
    return rollout_pb2.WeightsUpdateHeader(
        policy_version=update.policy_version,
        kind=update.kind,
        lora_config_json=update.lora_config_json,
        adapter_name=update.adapter_name,
        target=update.target,
    )
