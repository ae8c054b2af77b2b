"""LTX-2 (``LTX2Pipeline``): joint video and audio latents."""

from rollout_server.families.spec import FamilySpec, Preset

SPEC = FamilySpec(
    name="ltx2",
    adapters={"LTX2Pipeline": "LTX2Adapter"},
    # Every attention of both streams (the video's and the audio's self-attention, attn1 and
    # audio_attn1, and prompt cross-attention, attn2 and audio_attn2, and the audio-to-video and
    # video-to-audio attentions between them), and both streams' feed-forwards (".ff" does not match
    # "audio_ff", so each is named). The input and output projections, the caption projections and the
    # timestep modulation are left as they are.
    lora_targets=(
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "ff.net.0.proj",
        "ff.net.2",
        "audio_ff.net.0.proj",
        "audio_ff.net.2",
    ),
    presets={
        # 64: the VAE's decoder needs 2x2 latents (32x); 9 = 1 + 8 frames, two latent frames (8x, causal).
        "tiny-ltx2": Preset(
            "preset:build_ltx2_preset", "tiny", {"height": 64, "width": 64, "frames": 9, "num_steps": 10}
        )
    },
)
