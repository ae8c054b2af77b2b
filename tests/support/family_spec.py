"""What the family table (``support.families``) says of each family: its tiny preset, the conventions a
trainer replays it with, and its rows of the contract suite (tests/families/test_contract.py)."""

from dataclasses import dataclass, field
from typing import Any

from support.parity import TOLERANCE


@dataclass(frozen=True)
class Sp2Row:
    """A family's SP=2 contract row: fields over its FLOW_SDE request with CFG, the tolerance of the
    latents and velocities, and what the started event shows: the latent layout, the streams' shapes,
    the attention split, text states of uneven, odd lengths."""

    fields: dict[str, Any]
    tolerance: float = TOLERANCE
    layout: tuple[int, ...] = ()
    streams: tuple[tuple[int, ...], ...] = ()
    attention_split: str = ""
    uneven_text: bool = False


@dataclass(frozen=True)
class Family:
    """A model family's tiny preset and the conventions a trainer replays it with."""

    preset: str
    transformer: str  # the diffusers transformer class a trainer loads
    pipeline: str  # the diffusers pipeline class
    prompts: tuple[str, ...]  # of the requests built by ``family_request``
    base_seed: int
    cfg_on: dict  # request fields that turn the family's CFG on (its scale field, a negative prompt)
    cfg_off: dict
    timestep_divisor: float
    cfg_rule: tuple[str, float]  # the transformer call's guidance rule and scale with ``cfg_on``
    env_keys: frozenset[str]  # the transformer's kwargs besides hidden_states and timestep
    latent_shape: tuple[int, ...]  # one sample's latents at 64 x 64 pixels
    cfg_off_rule: tuple[str, float] = ("none", 1.0)  # the guidance rule and scale with ``cfg_off``
    # What the contract suite's replay-parity test covers: each sampler with CFG off and on, at each latent
    # dtype (None: the request leaves it unset).
    replay_samplers: tuple[str, ...] = ("FLOW_SDE", "CPS")
    replay_latent_dtypes: tuple[str | None, ...] = (None,)
    # The CFG settings it covers: off and on, or off alone for a family without CFG (cfg_on unused).
    replay_cfg: tuple[bool, ...] = (False, True)
    # The env entry of the text states [1, tokens, width]; "" for a transformer fed token ids (Cosmos3).
    text_key: str = "encoder_hidden_states"
    text_width: str = "joint_attention_dim"  # the transformer config entry of the text states' width
    # The pipeline's denoising transformers; a trainer replays with all of them by name when several.
    experts: tuple[str, ...] = ("transformer",)
    # The expert of each of the 4 steps of ``family_request``.
    step_transformers: tuple[str, ...] = ("transformer",) * 4
    # How the conditioning image's latents enter the call (image-conditioned families), and where.
    conditioning: tuple[str, str] = ("CONDITIONING_CONCAT_NONE", "")
    # Why the preset cannot be built on this machine (a library it needs is missing); "" if it can.
    missing: str = ""
    # The rows of the contract suite (tests/families/test_contract.py) beyond replay, which every family
    # has. What GetServerInfo says of the preset: attribute paths of the reply and their values (a
    # repeated field as a list; an optional field must be set).
    server_info: dict[str, Any] = field(default_factory=dict)
    # Capabilities GetServerInfo.features lists besides SERVED_FEATURES.
    features: frozenset[str] = frozenset()
    # num_frames values refused (off the frame step, or above the bound) for a video family.
    refused_frames: tuple[int, ...] = ()
    # The SP=2 row; None: none here (a file of its own runs the family at SP=2 beside other tests).
    sp2: Sp2Row | None = None
    # The LoRA row: a name the trained adapter's keys hold (the family's own modules); "": no row.
    lora_module: str = ""
