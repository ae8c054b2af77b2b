"""The contract every model family passes, parametrised over the family table (``support.families``,
keyed by family name): what GetServerInfo says of it, replay parity over gRPC through its real tiny
transformers (docs/design.md, invariant 1) for each of its samplers with CFG off and on and at each of
its latent dtypes, CFG turned on through the field GetServerInfo advertises, its refused frame counts,
SP=2 against SP=1, and a LoRA update. A family's own checks are in ``test_<family>.py`` beside this.

Replay: for every stochastic step a trainer recomputes the log-prob from the streamed x_i, timestep and
env and scores the streamed x_{i+1}; it must match the streamed log-prob within 1e-5, with the client
library's ``replay_log_probs`` and with a bare diffusers call plus the independent float64 reference
formula of ``support/reference.py``.
"""

import operator

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from support.errors import refused_rollout
from support.families import (
    FAMILIES,
    LONG_PROMPT,
    SERVED_FEATURES,
    SHORT_PROMPT,
    family_request,
    qwen_text_length,
)
from support.parity import TOLERANCE, assert_replays, assert_same_numbers
from support.requests import LATENT_DTYPES, split_events
from support.servers import stream_at_sp2
from support.weights import LORA_TARGETS, next_version, with_lora

from rollout.v1 import rollout_pb2
from rollout_client import replay_log_probs
from rollout_core.transformer_call import LatentConditioning


def rows(has) -> list[str]:
    """The families with a row of a check."""
    return [family for family, spec in FAMILIES.items() if has(spec)]


# What GetServerInfo says ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", rows(lambda spec: spec.server_info))
def test_server_info(family, family_client):
    spec = FAMILIES[family]
    info = family_client.server_info()
    for path, expected in spec.server_info.items():
        *parents, leaf = path.split(".")
        parent = operator.attrgetter(".".join(parents))(info) if parents else info
        value = getattr(parent, leaf)
        if isinstance(expected, list):
            value = list(value)
        elif isinstance(expected, float) and float(np.float32(expected)) != expected:
            expected = pytest.approx(expected)  # a float32 field: 0.7 is not exact in it
        assert value == expected, path
        field = parent.DESCRIPTOR.fields_by_name[leaf]
        if field.has_presence and field.message_type is None:
            assert parent.HasField(leaf), path  # an optional field given is set, not a default read
    assert spec.features <= set(info.features)
    assert list(info.features)[: len(SERVED_FEATURES)] == SERVED_FEATURES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cfg_turns_on_through_the_field_server_info_advertises(family, family_client):
    """A client that knows a model only by GetServerInfo turns CFG on by setting ``cfg_scale_field``
    above ``cfg_off_scale``, and gets a rollout with a negative branch combined by ``cfg_rule``. A
    model without CFG (rule "none": FLUX.2 [dev]) advertises no field, and every scale field it does
    not list in ``scale_fields`` is refused above its default, naming it."""
    info = family_client.server_info()
    assert (info.cfg_rule == "none") == (info.cfg_scale_field == "")
    assert set(info.scale_fields) <= {"guidance_scale", "true_cfg_scale"}
    small = {"samples_per_prompt": 1, "num_steps": 2, "latents": rollout_pb2.LATENT_SELECTION_NONE}
    if not info.cfg_scale_field:
        for field in {"guidance_scale", "true_cfg_scale"} - set(info.scale_fields):
            scale = {field: getattr(info.defaults, field) + 2.0}
            refused = family_request(family, "ODE", cfg=False, **small, **scale)
            assert [violation.field for violation in refused_rollout(family_client, refused)] == [field]
        return
    assert info.cfg_scale_field in info.scale_fields
    scale = {info.cfg_scale_field: info.cfg_off_scale + 2.0}
    request = family_request(family, "ODE", cfg=False, **small, **scale)
    started = split_events(family_client.stream(request)).started.message
    call = started.transformer_call
    assert list(call.branches) == ["positive", "negative"]
    assert (call.guidance_rule, call.guidance_rule_scale) == (info.cfg_rule, info.cfg_off_scale + 2.0)


# Refusals -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "frames"),
    [(family, frames) for family in FAMILIES for frames in FAMILIES[family].refused_frames],
)
def test_frames_off_the_frame_step_or_above_the_bound_are_refused(family, family_client, frames):
    violations = refused_rollout(family_client, family_request(family, "ODE", cfg=False, num_frames=frames))
    assert [violation.field for violation in violations] == ["num_frames"]


# Replay parity --------------------------------------------------------------------------------------


def replay_case(family: str, sampler: str, cfg: bool, dtype: str | None):
    name = "-".join(filter(None, (family, sampler, "cfg" if cfg else "no-cfg", dtype)))
    return pytest.param(family, sampler, cfg, dtype, id=name)


# Every family, each of its samplers with CFG off and on, at each of its latent dtypes (see FAMILIES:
# flux and z-image also cover DANCE and bfloat16 latents; qwen-image's and z-image's two prompts
# differ in length).
REPLAY_CASES = [
    replay_case(family, sampler, cfg, dtype)
    for family, spec in FAMILIES.items()
    for sampler in spec.replay_samplers
    for cfg in spec.replay_cfg
    for dtype in spec.replay_latent_dtypes
]


@pytest.mark.parametrize(("family", "sampler", "cfg", "latent_dtype"), REPLAY_CASES)
def test_streamed_log_probs_replay(
    family, family_client, family_transformer, family_resources, sampler, cfg, latent_dtype
):
    spec = FAMILIES[family]
    config = family_transformer["transformer"].config if len(spec.experts) > 1 else family_transformer.config
    request = family_request(family, sampler, cfg, latent_dtype=LATENT_DTYPES.get(latent_dtype))
    trajectories = family_client.rollout(request)
    assert [t.prompt_index for t in trajectories] == [0, 0, 1, 1]
    for trajectory in trajectories:
        call = trajectory.transformer_call
        assert call.timestep_divisor == spec.timestep_divisor
        rule = spec.cfg_rule if cfg else spec.cfg_off_rule
        assert (call.guidance_rule, call.guidance_rule_scale) == rule
        concat, env_key = spec.conditioning
        assert call.conditioning == LatentConditioning(rollout_pb2.ConditioningConcat.Value(concat), env_key)
        assert set(trajectory.env) == ({"positive", "negative"} if cfg else {"positive"})
        for env in trajectory.env.values():
            assert set(env) == spec.env_keys
            if spec.text_key:
                assert env[spec.text_key].shape[::2] == (1, config[spec.text_width])
            if "pooled_projections" in env:
                assert env["pooled_projections"].shape == (1, config.pooled_projection_dim)
        assert trajectory.latents.shape == (5, *spec.latent_shape)
        assert trajectory.step_transformers == list(spec.step_transformers)
        assert trajectory.latent_mask.all()
        # CPS's last step goes into sigma_T = 0 with sd = 0: deterministic, not scored.
        stochastic = [True, True, True, False] if sampler == "CPS" else [True] * 4
        assert trajectory.stochastic.tolist() == stochastic
        streamed = trajectory.log_probs
        assert torch.isfinite(streamed[trajectory.stochastic]).all()
        assert torch.isnan(streamed[~trajectory.stochastic]).all()
        if latent_dtype == "bfloat16":
            assert torch.equal(trajectory.latents, trajectory.latents.to(torch.bfloat16).float())
    assert_replays(family_transformer, trajectories, bare_reference=True)
    # Distinct samples of a group are scored separately (docs/design.md).
    assert not torch.equal(trajectories[0].log_probs, trajectories[1].log_probs)
    if family == "qwen-image":
        assert_each_sample_has_its_own_prompts_env(
            trajectories, family_resources.pipeline(family), family_transformer, cfg
        )


def assert_each_sample_has_its_own_prompts_env(trajectories, pipe, transformer, cfg: bool) -> None:
    """Qwen-Image's two prompts of different lengths in one request: each sample's env has its own
    prompt's length, unpadded, and replays its own sample only."""
    short, long = qwen_text_length(pipe, SHORT_PROMPT), qwen_text_length(pipe, LONG_PROMPT)
    assert short < long
    for trajectory in trajectories:
        lengths = {"positive": (short, long)[trajectory.prompt_index]}
        if cfg:
            lengths["negative"] = qwen_text_length(pipe, FAMILIES["qwen-image"].cfg_on["negative_prompt"])
        for branch, env in trajectory.env.items():
            assert env["encoder_hidden_states"].shape == (
                1,
                lengths[branch],
                transformer.config.joint_attention_dim,
            )
            # One unpadded prompt per env: QwenImagePipeline passes no mask then, and no guidance.
            assert env["encoder_hidden_states_mask"] is None and env["guidance"] is None
            assert env["img_shapes"] == [[[1, 4, 4]]]  # one sample, one frame, a 4x4 patch grid
            assert env["attention_kwargs"] == {} and env["return_dict"] is False
    # The env matters: the long prompt's env does not replay a short-prompt sample.
    trajectories[0].env = trajectories[2].env
    mismatch = replay_log_probs(transformer, trajectories[0]) - trajectories[0].log_probs
    assert mismatch.nan_to_num().abs().max() > TOLERANCE


# SP=2 -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", rows(lambda spec: spec.sp2))
def test_sp2_matches_sp1(family, family_client, family_transformer, cache_dir, tmp_path):
    """The family's request with CFG from a fresh server at --sp 2 (the split through the family's
    context-parallel plan or seams, gathered back) against its SP=1 server: x_0, eps and log-probs
    (float32 latents) bitwise, per stream too; latents and velocities within the row's tolerance; and
    the stream replays through a plain transformer."""
    spec = FAMILIES[family]
    debug = [rollout_pb2.DEBUG_TENSOR_EPS, rollout_pb2.DEBUG_TENSOR_VELOCITY]
    request = family_request(family, "FLOW_SDE", cfg=True, debug_tensors=debug, **spec.sp2.fields)
    runs = {1: split_events(family_client.stream(request))}
    runs[2] = stream_at_sp2(cache_dir, tmp_path / "sp2.log", spec.preset, request)
    started = runs[2].started.message
    if spec.sp2.layout:
        assert tuple(started.layout.shape) == spec.sp2.layout
    if spec.sp2.streams:
        assert [tuple(stream.shape) for stream in started.transformer_call.streams] == list(spec.sp2.streams)
    if spec.sp2.attention_split:
        assert started.attention_split == spec.sp2.attention_split
    if spec.sp2.uneven_text:
        lengths = {env[spec.text_key].shape[1] for env in runs[2].started.env["positive"]}
        assert len(lengths) == 2 and any(length % 2 for length in lengths)
    # Noise, and log-probs from eps: bitwise. Latents and velocities: Batch and split rounding
    # (docs/testing.md): each rank's projections and attention run on fewer rows and heads, which a
    # kernel on several threads may cut otherwise, and CFG at s takes a difference up to 2s - 1 times;
    # TOLERANCE is 10-100 times the typical difference for the random tiny presets (the pretrained
    # shapes network's row carries its own, derived in the table).
    assert_same_numbers(runs[1], runs[2], bitwise_log_probs=True, tolerance=spec.sp2.tolerance)
    streams = {stream.name for stream in started.transformer_call.streams}  # LTX-2's video and audio
    for one, two in zip(runs[1].steps, runs[2].steps, strict=True):
        assert one.stream_log_probs.keys() == two.stream_log_probs.keys() == streams
        for name, values in one.stream_log_probs.items():
            assert torch.equal(values, two.stream_log_probs[name])
    if len(spec.experts) == 1:
        assert set(runs[2].trajectories()[0].step_transformers) == {"transformer"}
    assert_replays(family_transformer, runs[2].trajectories())


# Weight updates -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", rows(lambda spec: spec.lora_module))
def test_a_lora_update_changes_the_rollouts_and_replays(family, family_client, family_transformer):
    """A trained PEFT LoRA on the family's attention, pushed as the next version: the rollout changes,
    the adapted transformer replays it and the base does not; a full update of the base weights
    puts the server back (bitwise the first rollout), for the other tests of this server."""
    request = family_request(family, "FLOW_SDE", cfg=False, samples_per_prompt=1, num_steps=2)
    base = family_client.rollout(request)
    adapted, config = with_lora(family_transformer, trained=True)
    adapter = get_peft_model_state_dict(adapted)
    assert any(FAMILIES[family].lora_module in name for name in adapter)  # the family's own modules
    family_client.update_weights(adapter, next_version(family_client), lora_config=config)
    info = family_client.server_info().lora_adapter
    assert list(info.target_modules) == sorted(LORA_TARGETS) and info.tensors == len(adapter)
    try:
        pushed = family_client.rollout(request)
        changed = max((p.latents[-1] - b.latents[-1]).abs().max() for p, b in zip(pushed, base, strict=True))
        assert changed > 1e-3, "the adapter must change the policy"
        assert_replays(adapted, pushed)
        with pytest.raises(AssertionError):
            assert_replays(family_transformer, pushed)
    finally:
        family_client.update_weights(family_transformer.state_dict(), next_version(family_client))
    restored = family_client.rollout(request)
    for one, two in zip(restored, base, strict=True):
        assert torch.equal(one.latents, two.latents)
