"""The trainer's default LoRA: its rank and scale. The modules it adapts are the server's default
targets (GetServerInfo's ``lora_targets``, module names as PEFT matches them), unless
``--lora-targets`` names others.
"""

DEFAULT_LORA_RANK = 8
DEFAULT_LORA_ALPHA = 32.0
