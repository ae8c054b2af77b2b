"""Stable Diffusion 3 and 3.5 (``StableDiffusion3Pipeline``)."""

from rollout_server.families.common.lora import JOINT_ATTENTION_TARGETS
from rollout_server.families.spec import FamilySpec, Preset

SPEC = FamilySpec(
    name="sd3",
    adapters={"StableDiffusion3Pipeline": "SD3Adapter"},
    # The joint attention of every MMDiT block (FlowGRPO's SD3 targets).
    lora_targets=JOINT_ATTENTION_TARGETS,
    presets={
        "tiny-sd3": Preset("preset:build_sd3_preset", "tiny", {"height": 128, "width": 128, "num_steps": 10})
    },
)
