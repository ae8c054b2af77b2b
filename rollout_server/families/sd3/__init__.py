"""Stable Diffusion 3 and 3.5 (``StableDiffusion3Pipeline``)."""

from rollout_server.families.spec import FamilySpec, Preset

# The attention of every MMDiT block, image and text streams (FlowGRPO's SD3 targets; SD3.5's second,
# image-only attention, attn2, is left as it is).
JOINT_ATTENTION_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)

SPEC = FamilySpec(
    name="sd3",
    adapters={"StableDiffusion3Pipeline": "SD3Adapter"},
    lora_targets=JOINT_ATTENTION_TARGETS,
    presets={
        "tiny-sd3": Preset("preset:build_sd3_preset", "tiny", {"height": 128, "width": 128, "num_steps": 10})
    },
)
