"""How a velocity is computed from the transformer and the frozen env: the one rule that the server
runs and that a trainer replays.

For each env branch (``positive``, and ``negative`` with CFG), with ``f`` the call's ``CallForm`` and
``c`` its ``LatentConditioning``::

    fed_timestep = (timesteps[B] - f.timestep_offset) / timestep_divisor
                 = (f.timestep_offset - timesteps[B]) / timestep_divisor    (f.timestep_reversed)
                   cast to model_dtype (kept float32 with f.timestep_float32)
    latents = x.to(model_dtype)                                       (conditioning NONE)
            = cat([x, env[c.env_key]], dim=1).to(model_dtype)         (SEQUENCE, CHANNELS)
    prediction = transformer(**{f.latents_argument: latents, f.timestep_argument: fed_timestep},
                             **env[branch] without env[c.env_key])[0]
    v_branch = prediction[:, :x.shape[1]].float(), negated with f.negated_prediction

where ``timesteps`` holds each row's timestep as float32 (a trainer replaying one step passes that
step's timestep for every row; a server batching rollouts at different steps passes one per row: the
numbers each row is fed are the same either way). Dim 1 is the token axis of [B, N, D] tokens
(SEQUENCE: FLUX.1 Kontext and Qwen-Image-Edit append the image's tokens, predict them too, and keep
the first N) and the channel axis of [B, C, F, H, W] latents (CHANNELS: Wan 2.1 image-to-video, whose
transformer predicts the C generated channels only, so the slice keeps all of them).

The form ``f.inputs`` says how the batch is handed over: BATCHED (every family but Z-Image) passes the
tensors as they are; PER_SAMPLE_FRAMES (Z-Image) passes a list of the B samples' latents, each with a
frame axis inserted at dim 1 ([C, H, W] becomes [C, 1, H, W]), every batched env tensor as the list
of its B rows, and reads the prediction back as a list of B [C, 1, H, W] tensors, stacked and the
frame axis dropped. PACKED_SAMPLE (Cosmos3, whose transformer packs one sample's text tokens and
latents into a single sequence) calls the transformer once per sample b: the latents as the list
``[x[b:b+1]]``, every batched env entry as its row b (the batch dimension dropped), the other entries
as they are, the row's fed timestep repeated once per element of the row of
``env[f.timestep_tokens_key]`` (a timestep per token), and the prediction ``output[0][0]`` ([1, ...]);
the B predictions are concatenated.

A family whose samples carry several latent streams (``f.streams``; LTX-2's video and audio) has x as
the joint latent [B, N] (``rollout_core.latent_streams``): the call passes each stream's part, viewed
at its shape, under its own argument instead of ``f.latents_argument``, and the velocity is the joint
of the transformer's outputs 0, 1, ... in stream order. ``f.timestep_copies`` names more arguments fed
the same timestep (LTX-2's ``sigma``).

The defaults (offset 0, the timestep cast, no negation, ``hidden_states`` and ``timestep``) are the
rule of the servers before these fields, exactly: ``t - 0`` is ``t``. Z-Image's pipeline feeds
``(1000 - t) / 1000``: offset 1000, reversed, divisor 1000, the same float32 operations. (``(t -
1000) / -1000`` would be the same number but for the sign of zero at t = 1000: ``t - t`` is +0 in
either order.)

then the guidance rule combines the branches in float32:

* ``none``: v = v_positive
* ``true_cfg``: v = v_negative + scale * (v_positive - v_negative)   (also SD3's classic CFG)
* ``true_cfg_norm_rescale`` (Qwen-Image): c = v_negative + scale * (v_positive - v_negative), then
  v = c * ||v_positive|| / ||c||, norms over the last dimension
* ``cfg_from_positive`` (Z-Image): v = v_positive + scale * (v_positive - v_negative). Its pipeline
  combines the raw predictions p and q this way and negates the sum; negating each branch first
  gives the same numbers, since negation is exact and rounding to nearest is symmetric in sign:
  -(p + s (p - q)) == (-p) + s ((-p) - (-q)), all but the sign of an exact zero.
"""

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf import json_format

from rollout.v1 import rollout_pb2
from rollout_core import latent_streams
from rollout_core.latent_streams import LatentStream

GUIDANCE_RULES = ("none", "true_cfg", "true_cfg_norm_rescale", "cfg_from_positive")
_CONCATENATED = (rollout_pb2.CONDITIONING_CONCAT_SEQUENCE, rollout_pb2.CONDITIONING_CONCAT_CHANNELS)
_INPUT_FORMS = (
    rollout_pb2.TRANSFORMER_INPUTS_BATCHED,
    rollout_pb2.TRANSFORMER_INPUTS_PER_SAMPLE_FRAMES,
    rollout_pb2.TRANSFORMER_INPUTS_PACKED_SAMPLE,
)


@dataclass(frozen=True)
class LatentConditioning:
    """The conditioning latents of a transformer call (rollout.v1 LatentConditioning): how they enter
    the hidden states (a ``ConditioningConcat``) and the env entry that holds them."""

    concat: int = rollout_pb2.CONDITIONING_CONCAT_NONE
    env_key: str = ""

    @classmethod
    def from_proto(cls, message: rollout_pb2.LatentConditioning) -> "LatentConditioning":
        # Servers before the field state nothing: they fed x alone.
        return cls(message.concat or rollout_pb2.CONDITIONING_CONCAT_NONE, message.env_key)

    def to_proto(self) -> rollout_pb2.LatentConditioning:
        return rollout_pb2.LatentConditioning(concat=self.concat, env_key=self.env_key)


NO_CONDITIONING = LatentConditioning()


@dataclass(frozen=True)
class CallForm:
    """How the latents and the timestep are handed to the transformer and its prediction read back
    (rollout.v1 TransformerCall fields 10 to 16 and 20). The defaults are the call of every family
    before Z-Image, and what a record from before the fields means."""

    inputs: int = rollout_pb2.TRANSFORMER_INPUTS_BATCHED  # a rollout.v1 TransformerInputs
    latents_argument: str = "hidden_states"
    timestep_argument: str = "timestep"
    timestep_offset: float = 0.0  # fed: (timestep - offset) / divisor
    timestep_reversed: bool = False  # fed: (offset - timestep) / divisor
    timestep_float32: bool = False  # the fed timestep is not cast to the model dtype
    negated_prediction: bool = False  # the velocity is minus the prediction
    # Several latent streams per sample (LTX-2), in order: x is their joint latent (latent_streams).
    streams: tuple[LatentStream, ...] = ()
    timestep_copies: tuple[str, ...] = ()  # more arguments fed the same timestep (LTX-2's sigma)
    # PACKED_SAMPLE: the env entry with one element per token fed a timestep (Cosmos3's noisy vision
    # tokens); the fed timestep is repeated to that many.
    timestep_tokens_key: str = ""

    @classmethod
    def from_proto(cls, message: rollout_pb2.TransformerCall) -> "CallForm":
        default = cls()
        return cls(
            inputs=message.inputs or default.inputs,
            latents_argument=message.latents_argument or default.latents_argument,
            timestep_argument=message.timestep_argument or default.timestep_argument,
            timestep_offset=message.timestep_offset,
            timestep_reversed=message.timestep_reversed,
            timestep_float32=message.timestep_float32,
            negated_prediction=message.negated_prediction,
            streams=tuple(LatentStream.from_proto(stream) for stream in message.streams),
            timestep_copies=tuple(message.timestep_copies),
            timestep_tokens_key=message.timestep_tokens_key,
        )

    def proto_fields(self) -> dict[str, Any]:
        """Its TransformerCall fields."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["streams"] = [stream.to_proto() for stream in self.streams]
        return fields


BATCHED_CALL = CallForm()


@dataclass(frozen=True)
class TransformerCall:
    """How the server called the transformer and combined the branches (rollout.v1 TransformerCall):
    what a trainer needs to replay a step, by the rule of this module's docstring
    (docs/protocol.md#calling-the-transformer); ``call_transformer`` and ``apply_guidance`` run it.
    ``form.inputs`` and ``conditioning.concat`` are rollout.v1 enum numbers (TransformerInputs 1
    BATCHED, 2 PER_SAMPLE_FRAMES, 3 PACKED_SAMPLE; ConditioningConcat 1 NONE, 2 SEQUENCE, 3
    CHANNELS; compare them with ``rollout_pb2``'s names), ``form.streams`` the latent streams of a
    sample (name, shape, argument), empty for one stream. Saved as the message's JSON mapping, so a
    file holds what the stream said, and a file of an earlier or later version loads (fields it
    lacks take their defaults, fields this version does not know are ignored)."""

    transformer_class: str  # diffusers class name, e.g. "FluxTransformer2DModel"
    model_dtype: str  # "float32", "bfloat16" or "float16"
    timestep_divisor: float  # fed: (timesteps[i] - form.timestep_offset) / timestep_divisor
    timestep_rule: str  # the same, in words
    guidance_rule: str  # one of GUIDANCE_RULES
    guidance_rule_scale: float  # the scale at every step, unless guidance_rule_scales lists them
    branches: tuple[str, ...]  # "positive", and "negative" with CFG
    batched_env_keys: tuple[str, ...]  # env entries with a leading batch dimension of 1 (see stack_envs)
    conditioning: LatentConditioning = NO_CONDITIONING
    form: CallForm = BATCHED_CALL
    # [T]: each step's scale, where experts have their own (Wan 2.2's guidance_scale_2); empty otherwise.
    guidance_rule_scales: tuple[float, ...] = ()

    def guidance_scale_at(self, i: int) -> float:
        """The scale of the guidance rule at step ``i``."""
        return self.guidance_rule_scales[i] if self.guidance_rule_scales else self.guidance_rule_scale

    @classmethod
    def from_proto(cls, message: rollout_pb2.TransformerCall) -> "TransformerCall":
        return cls(
            transformer_class=message.transformer_class,
            model_dtype=message.model_dtype,
            timestep_divisor=message.timestep_divisor,
            timestep_rule=message.timestep_rule,
            guidance_rule=message.guidance_rule,
            guidance_rule_scale=message.guidance_rule_scale,
            branches=tuple(message.branches),
            batched_env_keys=tuple(message.batched_env_keys),
            conditioning=LatentConditioning.from_proto(message.conditioning),
            form=CallForm.from_proto(message),
            guidance_rule_scales=tuple(message.guidance_rule_scales),
        )

    def to_proto(self) -> rollout_pb2.TransformerCall:
        return rollout_pb2.TransformerCall(
            transformer_class=self.transformer_class,
            model_dtype=self.model_dtype,
            timestep_divisor=self.timestep_divisor,
            timestep_rule=self.timestep_rule,
            guidance_rule=self.guidance_rule,
            guidance_rule_scale=self.guidance_rule_scale,
            branches=self.branches,
            batched_env_keys=self.batched_env_keys,
            conditioning=self.conditioning.to_proto(),
            guidance_rule_scales=self.guidance_rule_scales,
            **self.form.proto_fields(),
        )

    @classmethod
    def from_json(cls, text: str) -> "TransformerCall":
        message = json_format.Parse(text, rollout_pb2.TransformerCall(), ignore_unknown_fields=True)
        return cls.from_proto(message)

    def to_json(self) -> str:
        return json_format.MessageToJson(
            self.to_proto(),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
            indent=None,
            sort_keys=True,
        )


def call_transformer(
    transformer: torch.nn.Module,
    x: torch.Tensor,
    timestep: float | torch.Tensor,
    env: Mapping[str, Any],
    model_dtype: torch.dtype,
    timestep_divisor: float,
    conditioning: LatentConditioning = NO_CONDITIONING,
    form: CallForm = BATCHED_CALL,
    batched_env_keys: Iterable[str] = (),
) -> torch.Tensor:
    """One branch's velocity, float32, for the batch ``x`` [B, ...]; ``timestep`` is one value for
    every row, or float32 [B], one per row; ``env[conditioning.env_key]`` holds the conditioning
    latents of the rows when ``conditioning`` concatenates them; ``batched_env_keys`` name the env
    entries with a row per sample, which the PER_SAMPLE_FRAMES form passes as lists (see the module
    docstring)."""
    if form.inputs not in _INPUT_FORMS:
        raise ValueError(f"unknown transformer inputs {form.inputs}: a rule newer than this client")
    per_sample = form.inputs == rollout_pb2.TRANSFORMER_INPUTS_PER_SAMPLE_FRAMES
    packed = form.inputs == rollout_pb2.TRANSFORMER_INPUTS_PACKED_SAMPLE
    if (per_sample or packed) and conditioning.concat in _CONCATENATED:
        raise ValueError("per-sample inputs take no conditioning latents")
    if form.streams and (per_sample or packed or conditioning.concat in _CONCATENATED):
        raise ValueError("latent streams take neither per-sample inputs nor conditioning latents")
    fed_timestep = torch.as_tensor(timestep, dtype=torch.float32, device=x.device).expand(x.shape[0])
    if form.timestep_reversed:
        fed_timestep = (form.timestep_offset - fed_timestep) / timestep_divisor
    else:
        fed_timestep = (fed_timestep - form.timestep_offset) / timestep_divisor
    if not form.timestep_float32:
        fed_timestep = fed_timestep.to(model_dtype)
    latents = x.to(model_dtype)
    if conditioning.concat in _CONCATENATED:
        env = dict(env)
        latents = torch.cat([latents, env.pop(conditioning.env_key).to(model_dtype)], dim=1)
    elif conditioning.concat != rollout_pb2.CONDITIONING_CONCAT_NONE:
        raise ValueError(f"unknown conditioning concat {conditioning.concat}: a rule newer than this client")
    if packed:
        width = x.shape[1]
        return _packed_sample_call(transformer, latents, fed_timestep, env, form, batched_env_keys, width)
    if per_sample:
        batched = set(batched_env_keys)
        latents = list(latents.unsqueeze(2).unbind(0))
        env = {
            key: list(value.unbind(0)) if key in batched and isinstance(value, torch.Tensor) else value
            for key, value in env.items()
        }
    timesteps = dict.fromkeys((form.timestep_argument, *form.timestep_copies), fed_timestep)
    if form.streams:
        parts = latent_streams.split(latents, form.streams)
        inputs = {stream.argument: part for stream, part in zip(form.streams, parts, strict=True)}
        output = transformer(**inputs, **timesteps, **env)
        velocity = latent_streams.join(output[: len(form.streams)]).float()
        return -velocity if form.negated_prediction else velocity
    output = transformer(**{form.latents_argument: latents}, **timesteps, **env)
    prediction = output[0] if isinstance(output, tuple) else output.sample
    if per_sample:
        prediction = torch.stack(prediction).squeeze(2)
    velocity = prediction[:, : x.shape[1]].float()
    return -velocity if form.negated_prediction else velocity


def _packed_sample_call(
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    fed_timestep: torch.Tensor,
    env: Mapping[str, Any],
    form: CallForm,
    batched_env_keys: Iterable[str],
    width: int,
) -> torch.Tensor:
    """The PACKED_SAMPLE form: one transformer call per sample (see the module docstring)."""
    batched = set(batched_env_keys)
    predictions = []
    for b in range(latents.shape[0]):
        row = {
            key: value[b] if key in batched and isinstance(value, torch.Tensor) else value
            for key, value in env.items()
        }
        timestep = fed_timestep[b].repeat(row[form.timestep_tokens_key].numel())
        output = transformer(
            **{form.latents_argument: [latents[b : b + 1]], form.timestep_argument: timestep}, **row
        )
        predictions.append((output[0] if isinstance(output, tuple) else output.sample)[0])
    velocity = torch.cat(predictions)[:, :width].float()
    return -velocity if form.negated_prediction else velocity


def apply_guidance(rule: str, scale: float, velocities: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Combine branch velocities (float32) by the guidance rule."""
    if rule not in GUIDANCE_RULES:
        raise ValueError(f"unknown guidance rule {rule!r}; expected one of {GUIDANCE_RULES}")
    if rule == "none":
        return velocities["positive"]
    positive, negative = velocities["positive"], velocities["negative"]
    if rule == "cfg_from_positive":
        return positive + scale * (positive - negative)
    combined = negative + scale * (positive - negative)
    if rule == "true_cfg":
        return combined
    return combined * (
        torch.norm(positive, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
    )


def stack_envs(envs: Iterable[Mapping[str, Any]], batched_keys: Iterable[str]) -> dict[str, Any]:
    """Batch per-sample envs: batched tensors concatenate along dim 0, batched lists concatenate,
    shared (and absent, None) entries are taken from the first env."""
    envs = list(envs)
    batched = set(batched_keys)
    stacked = {}
    for key, first in envs[0].items():
        if key not in batched or first is None:
            stacked[key] = first
        elif isinstance(first, torch.Tensor):
            stacked[key] = torch.cat([env[key] for env in envs])
        else:
            stacked[key] = [item for env in envs for item in env[key]]
    return stacked
