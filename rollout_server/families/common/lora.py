"""LoRA target lists more than one family's spec uses."""

# The attention of every MMDiT block, image and text streams (FlowGRPO's SD3 targets; SD3.5's second,
# image-only attention, attn2, is left as it is).
JOINT_ATTENTION_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
