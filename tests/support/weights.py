"""Weight updates: a server's policy fingerprint, raw UpdateWeights streams, and the trainer's copies (a
perturbed transformer, a PEFT LoRA)."""

import copy
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_core import codec
from support.requests import stream_events

if TYPE_CHECKING:
    from rollout_client import RolloutClient

TO_Q = "transformer_blocks.0.attn.to_q.weight"
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# A small rollout whose final latents show the policy a server runs.
FINGERPRINT_REQUEST = {
    "prompts": ["a lighthouse"],
    "samples_per_prompt": 1,
    "base_seed": 5,
    "height": 64,
    "width": 64,
    "num_steps": 2,
    "debug_tensors": [rollout_pb2.DEBUG_TENSOR_EPS],
    "images": False,
}


def next_version(client: "RolloutClient") -> int:
    return client.server_info().policy_version + 1


def fingerprint(client: "RolloutClient") -> tuple:
    """The policy version, the LoRA adapter and the final latents of a small rollout."""
    info = client.server_info()
    rollout = stream_events(client, FINGERPRINT_REQUEST)
    return info.policy_version, info.lora_adapter.SerializeToString(), rollout.steps[-1].x_next


def assert_unchanged(before: tuple, client: "RolloutClient") -> None:
    """Same version, same adapter, bitwise the same final latents as ``before`` (a fingerprint)."""
    after = fingerprint(client)
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])


def push_update(
    client: "RolloutClient", header: rollout_pb2.WeightsUpdateHeader, data: bytes, timeout: float
) -> None:
    """A raw UpdateWeights stream: ``data`` in 4 KiB messages after ``header``."""
    messages = [rollout_pb2.UpdateWeightsRequest(header=header)]
    messages += [rollout_pb2.UpdateWeightsRequest(data=piece) for piece in codec.pieces(data, 4096)]
    client.stub.UpdateWeights(iter(messages), timeout=timeout)


def perturbed(transformer: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The trainer's copy after an optimiser step (a seeded perturbation of every weight)."""
    trained = copy.deepcopy(transformer)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return trained


def with_lora(transformer: torch.nn.Module, trained: bool, targets: list[str] = LORA_TARGETS):
    """The trainer's copy with a PEFT LoRA adapter on ``targets``, freshly initialised (lora_B = 0) or
    trained, and its LoraConfig."""
    from peft import LoraConfig

    adapted = copy.deepcopy(transformer)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    adapted.add_adapter(config)
    if trained:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, parameter in adapted.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return adapted, config
