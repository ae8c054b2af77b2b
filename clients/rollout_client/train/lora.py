"""The trainer's default LoRA: its rank and scale, and the modules it adapts in each model family.

Targets are module names as PEFT matches them (a name, or the end of a dotted one). Each family's list
names linear layers of its published transformers (tests/test_real_sizes.py checks them on the real
module trees); ``--lora-targets`` overrides it.
"""

DEFAULT_LORA_RANK = 8
DEFAULT_LORA_ALPHA = 32.0
# FLUX's attention and feed-forward layers, with the latent projections in and out.
FLUX_TARGETS = ("x_embedder", "to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_out")
# The attention of every MMDiT block, image and text streams (FlowGRPO's SD3 targets; SD3.5's second,
# image-only attention, attn2, is left as it is).
SD3_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
# Qwen-Image's joint attention and both streams' feed-forwards.
QWEN_IMAGE_TARGETS = (
    *SD3_TARGETS,
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
# Wan's self- and cross-attention projections and its feed-forward.
WAN_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
# FLUX.2's: the double-stream blocks' attention and image feed-forward, the single-stream blocks' fused
# attention and feed-forward input projection, and the latent projections in and out.
FLUX2_TARGETS = (
    "x_embedder",
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "ff.linear_in",
    "ff.linear_out",
    "to_qkv_mlp_proj",
    "proj_out",
)
# Z-Image's: the attention and the gated feed-forward of every block (refiners included).
Z_IMAGE_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)
# HunyuanVideo 1.5's: the joint attention of every dual-stream block (and of the text token refiner), and
# both streams' feed-forwards.
HUNYUAN_VIDEO15_TARGETS = (
    *SD3_TARGETS,
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
# Cosmos3's: the generation pathway of every mixture-of-transformers layer (the attention projections
# its vision tokens use, and its feed-forward); the understanding (text) pathway is the vision-language
# model's, left as it is. Cosmos3-Edge's relu2 feed-forward has no gate_proj, which then matches nothing.
COSMOS3_TARGETS = (
    "self_attn.add_q_proj",
    "self_attn.add_k_proj",
    "self_attn.add_v_proj",
    "self_attn.to_add_out",
    "mlp_moe_gen.gate_proj",
    "mlp_moe_gen.up_proj",
    "mlp_moe_gen.down_proj",
)
# LTX-2's: every attention of both streams (the video's and the audio's self-attention, attn1 and
# audio_attn1, and prompt cross-attention, attn2 and audio_attn2, and the audio-to-video and
# video-to-audio attentions between them), and both streams' feed-forwards (".ff" does not match
# "audio_ff", so each is named). The input and output projections, the caption projections and the
# timestep modulation are left as they are.
LTX2_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
    "audio_ff.net.0.proj",
    "audio_ff.net.2",
)
# --lora-targets' default, by the server's family.
LORA_TARGETS = {
    "flux": FLUX_TARGETS,
    "flux-kontext": FLUX_TARGETS,
    "flux2": FLUX2_TARGETS,
    "flux2-klein": FLUX2_TARGETS,
    "sd3": SD3_TARGETS,
    "qwen-image": QWEN_IMAGE_TARGETS,
    "qwen-image-edit": QWEN_IMAGE_TARGETS,
    "wan": WAN_TARGETS,
    "wan-i2v": WAN_TARGETS,
    "hunyuan-video15": HUNYUAN_VIDEO15_TARGETS,
    "cosmos3": COSMOS3_TARGETS,
    "ltx2": LTX2_TARGETS,
    "z-image": Z_IMAGE_TARGETS,
}
