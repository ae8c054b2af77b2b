"""Cosmos3 (``Cosmos3OmniPipeline``): a mixture-of-transformers over a vision-language model."""

from rollout_server.families.spec import FamilySpec, Preset

SPEC = FamilySpec(
    name="cosmos3",
    adapters={"Cosmos3OmniPipeline": "Cosmos3Adapter"},
    # The generation pathway of every mixture-of-transformers layer (the attention projections its
    # vision tokens use, and its feed-forward); the understanding (text) pathway is the vision-language
    # model's, left as it is. Cosmos3-Edge's relu2 feed-forward has no gate_proj, which then matches
    # nothing.
    lora_targets=(
        "self_attn.add_q_proj",
        "self_attn.add_k_proj",
        "self_attn.add_v_proj",
        "self_attn.to_add_out",
        "mlp_moe_gen.gate_proj",
        "mlp_moe_gen.up_proj",
        "mlp_moe_gen.down_proj",
    ),
    presets={
        "tiny-cosmos3": Preset(
            "preset:build_cosmos3_preset", "tiny", {"height": 64, "width": 64, "frames": 5, "num_steps": 10}
        )
    },
)
