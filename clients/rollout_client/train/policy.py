"""The trained policy: a LoRA of the transformer or all of it, pushed to the server over gRPC or a
weight-sync group with the checksum checked, and saved where LoadWeights and diffusers take it."""

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import torch
from peft import LoraConfig, get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file

from rollout_client.train.rollouts import ServerFailure, Watchdog, say
from rollout_client.updates import WeightsUpdate
from rollout_client.weight_sync import ChecksumMismatch
from rollout_core import checksum

if TYPE_CHECKING:
    from rollout_client import RolloutClient
    from rollout_client.train.config import TrainConfig
    from rollout_client.weight_sync import WeightSyncGroup


def load_policy(
    model_path: Path, config: "TrainConfig", served_targets: Sequence[str]
) -> tuple[torch.nn.Module, LoraConfig | None]:
    """The base transformer, frozen, with a trainable LoRA on the modules --lora-targets names, or else
    on the server's default targets (``served_targets``, GetServerInfo's ``lora_targets``); or, with
    --train full, all trainable. ServerFailure when neither names a target."""
    from diffusers import AutoModel  # the trainer's side; the client library never imports diffusers

    targets = config.optim.lora_targets.split(",") if config.optim.lora_targets else list(served_targets)
    if config.optim.train == "lora" and not targets:
        raise ServerFailure("the server names no default LoRA targets: pass --lora-targets")
    transformer = AutoModel.from_pretrained(str(model_path), subfolder="transformer").to(config.device)
    if config.optim.train == "full":
        return transformer, None
    transformer.requires_grad_(False)
    config = LoraConfig(r=config.optim.lora_rank, lora_alpha=config.optim.lora_alpha, target_modules=targets)
    transformer.add_adapter(config)
    return transformer, config


def lora_modules(transformer: torch.nn.Module) -> list[str]:
    """The modules a LoRA is attached to."""
    return sorted(name for name, module in transformer.named_modules() if isinstance(module, BaseTunerLayer))


def trainable_state(transformer: torch.nn.Module, config: "TrainConfig") -> dict[str, torch.Tensor]:
    """What the optimizer trains: the LoRA's tensors, or (--train full) the transformer's."""
    return (
        transformer.state_dict() if config.optim.train == "full" else get_peft_model_state_dict(transformer)
    )


class Pusher:
    """Sends the trainer's policy as the server's next policy version (whatever the server held
    before: another run's policy, or none after a restart), over gRPC or the weight-sync group
    (--weight-sync), and checks what the server then serves: the checksum of the trainer's own
    weights, and for a LoRA the modules it bound. Each call's deadline is ``stall_seconds``."""

    def __init__(self, client: "RolloutClient", transformer, lora_config: LoraConfig | None, config):
        self.client, self.transformer, self.lora_config, self.config = (
            client,
            transformer,
            lora_config,
            config,
        )
        self.group: WeightSyncGroup | None = None  # created at the first push over the group
        self.trained = lora_modules(transformer) if lora_config is not None else []
        # A LoRA run's base never changes: its part of the checksum is computed once.
        self.base_lines = {}
        if lora_config is not None:
            base = checksum.policy_tensors({"transformer": checksum.base_tensors(transformer)})
            self.base_lines = checksum.digest_lines(base)

    def weights(self) -> dict[str, torch.Tensor]:
        """What a push sends: the adapter, or every tensor of the transformer."""
        if self.lora_config is None:
            return {name: t.detach().cpu() for name, t in self.transformer.state_dict().items()}
        return {name: t.detach().cpu() for name, t in get_peft_model_state_dict(self.transformer).items()}

    def expected_checksum(self, weights: dict[str, torch.Tensor]) -> str:
        if self.lora_config is None:
            return checksum.weights_checksum(checksum.policy_tensors({"transformer": weights}))
        adapter = checksum.policy_tensors({}, {"transformer": weights})
        return checksum.combine(self.base_lines | checksum.digest_lines(adapter))

    def push(self) -> int:
        """Push the policy; returns its version."""
        weights, client = self.weights(), self.client
        expected = self.expected_checksum(weights)
        kind = "full" if self.lora_config is None else "lora"
        with Watchdog("policy push", self.config.server.stall_timeout):
            version = client.server_info().policy_version + 1
            if self.config.weight_sync == "group":
                served = self._push_over_group(weights, version, kind, expected)
            else:
                pushed = client.push(WeightsUpdate(weights, version, kind, self.lora_config), progress=False)
                served = pushed.weights_checksum
            bound = list(client.server_info().lora_adapter.modules)
        if served != expected:
            raise ServerFailure(f"the server serves weights {served}, not the trained {expected}")
        if bound != self.trained:
            raise ServerFailure(f"the server's LoRA binds {bound}, not the trained {self.trained}")
        return version

    def _push_over_group(self, weights, version: int, kind: str, expected: str) -> str:
        if self.group is not None and not all(self.group.joined()):
            # The server restarted, or joined another trainer's group: it is not in this one, so it
            # gets a new group (leaving the old one needs no call: the server already has).
            say("the server is no longer in the weight-sync group: forming a new one")
            self.group = None
        if self.group is None:
            self.group = self.client.init_weight_sync(
                master_address=self.config.sync.address, timeout=self.config.server.stall_timeout
            )
        try:
            [applied] = self.group.push(
                WeightsUpdate(weights, version, kind, self.lora_config), expect_checksum=expected
            )
        except ChecksumMismatch as mismatch:
            raise ServerFailure(f"the push of policy {version} over the group: {mismatch}") from None
        except Exception:
            self.group = None  # a failed update may have torn the group down: a retry joins a new one
            raise
        return applied.weights_checksum

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(grpc.RpcError):
                self.group.close()


def save_policy(transformer: torch.nn.Module, config: LoraConfig | None, out: Path, suffix: str = "") -> Path:
    """The trained policy, where ``LoadWeights`` (and diffusers) take it: the LoRA as a PEFT adapter
    folder ``lora{suffix}/``, or the whole transformer as a diffusers model folder
    ``transformer{suffix}/``."""
    if config is None:
        transformer.save_pretrained(out / f"transformer{suffix}")
        return out / f"transformer{suffix}"
    save_adapter(transformer, config, out / f"lora{suffix}")
    return out / f"lora{suffix}"


def save_adapter(transformer: torch.nn.Module, config: LoraConfig, folder: Path) -> None:
    """The LoRA as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors): what
    ``LoadWeights`` takes, and what ``peft`` and diffusers load."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    weights = get_peft_model_state_dict(transformer)
    save_file(
        {name: t.detach().cpu().contiguous() for name, t in weights.items()},
        folder / "adapter_model.safetensors",
    )
