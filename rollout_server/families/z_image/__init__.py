"""Z-Image (``ZImagePipeline``)."""

from rollout_server.families.spec import FamilySpec, Preset

SPEC = FamilySpec(
    name="z_image",
    adapters={"ZImagePipeline": "ZImageAdapter"},
    # The attention and the gated feed-forward of every block (refiners included).
    lora_targets=(
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    ),
    presets={
        "tiny-z-image": Preset(
            "preset:build_z_image_preset", "tiny", {"height": 128, "width": 128, "num_steps": 10}
        )
    },
)
