"""FLUX.1 [dev] (``FluxPipeline``) and FLUX.1 Kontext [dev] (``FluxKontextPipeline``).

The ``shapes`` preset lives here too: it is a ``FluxPipeline`` (FLUX.1's architecture at a size a CPU
trains, pretrained by ``examples/pretrain_shapes.py``), served by ``FluxAdapter`` like any FLUX.1
folder; its builder (``shapes.py``) is the FLUX.1 builder with its own sizes and weights.
"""

from rollout_server.families.spec import FamilySpec, Preset

TINY = {"height": 128, "width": 128, "num_steps": 10}

SPEC = FamilySpec(
    name="flux",
    adapters={"FluxPipeline": "FluxAdapter", "FluxKontextPipeline": "FluxKontextAdapter"},
    # The attention and feed-forward layers, with the latent projections in and out.
    lora_targets=("x_embedder", "to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_out"),
    presets={
        "tiny-flux": Preset("preset:build_flux_preset", "tiny", TINY),
        "small-flux": Preset("preset:build_flux_preset", "small", {**TINY, "height": 256, "width": 256}),
        "tiny-flux-kontext": Preset("preset:build_flux_kontext_preset", "tiny", TINY),
        # The size it was pretrained at, and true CFG against the empty caption it was also trained on.
        "shapes": Preset(
            "shapes:build_shapes_preset",
            "pretrained",
            {"height": 64, "width": 64, "num_steps": 20, "true_cfg_scale": 3.0},
        ),
    },
    preset_data=("shapes_weights",),
)
