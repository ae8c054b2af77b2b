"""Wan 2.1 and Wan 2.2 text-to-video (``WanPipeline``; 2.2's two experts by the boundary ratio)."""

from rollout_server.families.spec import FamilySpec, Preset

TINY = {"height": 64, "width": 64, "frames": 5, "num_steps": 10}
# The self- and cross-attention projections and the feed-forward.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")

SPEC = FamilySpec(
    name="wan",
    adapters={"WanPipeline": "WanAdapter"},
    lora_targets=LORA_TARGETS,
    presets={
        "tiny-wan": Preset("preset:build_wan_preset", "tiny", TINY),
        "tiny-wan2.2": Preset("preset:build_wan_preset", "tiny-2.2", TINY),
    },
)
