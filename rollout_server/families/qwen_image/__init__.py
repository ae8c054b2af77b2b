"""Qwen-Image (``QwenImagePipeline``) and Qwen-Image-Edit (``QwenImageEditPipeline``)."""

from rollout_server.families.common.lora import JOINT_ATTENTION_TARGETS
from rollout_server.families.spec import FamilySpec, Preset

TINY = {"height": 128, "width": 128, "num_steps": 10}

SPEC = FamilySpec(
    name="qwen_image",
    adapters={"QwenImagePipeline": "QwenImageAdapter", "QwenImageEditPipeline": "QwenImageEditAdapter"},
    # The joint attention and both streams' feed-forwards.
    lora_targets=(
        *JOINT_ATTENTION_TARGETS,
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    ),
    presets={
        "tiny-qwen-image": Preset("preset:build_qwen_image_preset", "tiny", TINY),
        "tiny-qwen-image-edit": Preset("preset:build_qwen_image_edit_preset", "tiny", TINY),
    },
)
