"""Wan 2.1 image-to-video (``WanImageToVideoPipeline``): Wan's transformer conditioned on a first frame."""

from rollout_server.families import wan
from rollout_server.families.spec import FamilySpec, Preset

SPEC = FamilySpec(
    name="wan_i2v",
    adapters={"WanImageToVideoPipeline": "WanImageToVideoAdapter"},
    lora_targets=wan.LORA_TARGETS,
    presets={"tiny-wan-i2v": Preset("preset:build_wan_i2v_preset", "tiny", wan.TINY)},
)
