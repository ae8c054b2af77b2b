"""FLUX.2 [dev] (``Flux2Pipeline``) and FLUX.2 [klein] (``Flux2KleinPipeline``)."""

from rollout_server.families.spec import FamilySpec, Preset

TINY = {"height": 128, "width": 128, "num_steps": 10}

SPEC = FamilySpec(
    name="flux2",
    adapters={"Flux2Pipeline": "Flux2Adapter", "Flux2KleinPipeline": "Flux2KleinAdapter"},
    # The double-stream blocks' attention and image feed-forward, the single-stream blocks' fused
    # attention and feed-forward input projection, and the latent projections in and out.
    lora_targets=(
        "x_embedder",
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "ff.linear_in",
        "ff.linear_out",
        "to_qkv_mlp_proj",
        "proj_out",
    ),
    presets={
        "tiny-flux2": Preset("preset:build_flux2_preset", "tiny", TINY),
        "tiny-flux2-klein": Preset("preset:build_flux2_klein_preset", "tiny", TINY),
    },
)
