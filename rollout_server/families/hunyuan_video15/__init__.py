"""HunyuanVideo 1.5 (``HunyuanVideo15Pipeline``)."""

from rollout_server.families.common.lora import JOINT_ATTENTION_TARGETS
from rollout_server.families.spec import FamilySpec, Preset

SPEC = FamilySpec(
    name="hunyuan_video15",
    adapters={"HunyuanVideo15Pipeline": "HunyuanVideo15Adapter"},
    # The joint attention of every dual-stream block (and of the text token refiner), and both
    # streams' feed-forwards.
    lora_targets=(
        *JOINT_ATTENTION_TARGETS,
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ),
    presets={
        "tiny-hunyuan-video15": Preset(
            "preset:build_hunyuan_video15_preset",
            "tiny",
            {"height": 64, "width": 64, "frames": 5, "num_steps": 10},
        )
    },
)
