r"""SGLang-Diffusion's rollout API on our engine: its ``RolloutRequest`` read into ours, and a finished
rollout written back as its list of ``RolloutResponse`` (one per sample).

The fields and their meanings follow SGLang's released package (``sglang.multimodal_gen.runtime.
entrypoints.post_training``); where ours differ, the request is mapped as follows
(docs/sglang-compat.md has the whole table):

* ``rollout_sde_type`` sde, cps, ode, dance -> FLOW_SDE, CPS, ODE, DANCE (dance beside SGLang's
  three); ``rollout=False`` (evaluation) -> ODE with no trajectory; ``rollout_sde_step_indices`` ->
  ``stochastic_steps`` (any order, repeats ignored; an empty list leaves no stochastic step, so ODE);
  ``rollout_log_prob_no_const`` -> not ``log_prob_constants`` (SGLang's default, constants included,
  for CPS too).
* ``seed`` s with ``num_outputs_per_prompt`` n -> the explicit seeds s, s + 1, .. s + n - 1, as SGLang
  numbers its outputs; each response carries its own sample's seed. Without a seed the server draws
  a base seed, and each response still names its sample's seed.
* ``rollout_debug_mode``: SGLang's model defaults it to true, which multiplies the payload by four;
  a body that leaves it out gets false here.
* ``extra_sampling_params``: SGLang merges it into its ``SamplingParams``. A RolloutRequest field set
  there is merged over the body's; ``seed`` may be a list (one per output, as SGLang takes it);
  Wan 2.2's ``guidance_scale_2`` and ``boundary_ratio`` become ours; options that change nothing this
  server returns (output files, logs, profiling) are read and ignored; any other is refused by name.

Where SGLang accepts a field and does not use it, so does this front end, and says so: the answer's
``X-Rollout-Ignored-Fields`` header and a log line name it (gRPC stays strict). These are keys
SGLang's model does not know, a scale the model does not read, the negative prompt while CFG is off,
the second expert's fields on a model with one, and the read-only fields (``generator_device``,
``fps``, ``suppress_logs``) set to a value other than SGLang's default.

A response's tensors: ``rollout_log_probs`` float32 [T], 0 at deterministic steps as in SGLang;
``dit_trajectory.latents`` [K, ...] at ``step_indices`` and ``latent_step_indices`` (0 .. T, T the
final latent; all of them unless ``rollout_return_step_indices``), with ``timesteps`` [K] and
``sigmas`` [T + 1]; for a sample with several latent streams (LTX-2), ``stream_trajectories`` with
each stream's latents apart, as SGLang's multi-stream contract names them; ``denoising_env`` with each
CFG branch's whole transformer call besides hidden_states and timestep (``pos_cond_kwargs``,
``neg_cond_kwargs``, with the keys SGLang's pipeline configs add for the family beside them, named in
``sglang_keys``; the embedded ``guidance`` repeated apart, as SGLang reports it; an image-conditioned
family's conditioning latents in ``image_kwargs``), ``transformer_call`` (how to feed the timestep and
combine the branches) and ``step_transformers`` (each step's expert); ``generated_output`` the decoded
sample, float32 in [0, 1], [3, H, W] for an image and [3, F, H, W] for a video.
"""

import json
import math
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy
import torch
from safetensors.torch import save

from rollout.v1 import rollout_pb2
from rollout_core import dtypes, latent_streams, wire
from rollout_core.transformer_call import TransformerCall
from rollout_server.errors import InvalidRequest
from rollout_server.limits import MAX_POLICY_VERSION
from rollout_server.quoting import quoted
from rollout_server.validation import SCALE_FIELDS
from rollout_server.weights import payload
from rollout_server.weights.lora_config import MAX_RANK
from rollout_server.weights.spec import check_target, check_version
from rollout_server.weights.update import FULL, LORA, SUBSET, WeightUpdate

if TYPE_CHECKING:
    from rollout_server.memory import SampleSizes
    from rollout_server.validation import ServingContext

SDE_TYPES = {
    "sde": rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
    "cps": rollout_pb2.SAMPLER_TYPE_CPS,
    "ode": rollout_pb2.SAMPLER_TYPE_ODE,
    "dance": rollout_pb2.SAMPLER_TYPE_DANCE,
}
_MAX_SEED = 2**64 - 1
_MAX_SHORT_STRING = 64  # generator_device
_MAX_FPS = 1000
# One response's fixed cost beyond its tensors (keys, shapes, scalars): a generous bound.
_RESPONSE_OVERHEAD_BYTES = 64 * 1024
_DEBUG_TENSORS = [
    rollout_pb2.DEBUG_TENSOR_EPS,
    rollout_pb2.DEBUG_TENSOR_MEAN,
    rollout_pb2.DEBUG_TENSOR_SD,
    rollout_pb2.DEBUG_TENSOR_VELOCITY,
]
# Our request fields by the SGLang field a client set, so that a rejection names what it sent.
SGLANG_NAMES = {
    "prompts": "prompt",
    "negative_prompt": "negative_prompt",
    "seeds": "seed",
    "samples_per_prompt": "num_outputs_per_prompt",
    "height": "height",
    "width": "width",
    "num_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "true_cfg_scale": "true_cfg_scale",
    "num_frames": "num_frames",
    "sampler": "rollout_sde_type",
    "noise_level": "rollout_noise_level",
    "stochastic_steps": "rollout_sde_step_indices",
    "log_prob_constants": "rollout_log_prob_no_const",
    "guidance_scale_2": "extra_sampling_params.guidance_scale_2",
    "boundary_ratio": "extra_sampling_params.boundary_ratio",
}
# The response header that names the fields a request set and this front end did not use.
IGNORED_HEADER = "X-Rollout-Ignored-Fields"
_MAX_IGNORED_NAMED = 32  # names in the header and the log line; the rest are counted

# SGLang's RolloutRequest fields: (type, default). "ints" is a list of integers; None a null value.
# An integer takes the range of the proto field it becomes (uint32; see _INT_RANGES).
_OPTIONAL = None
FIELDS: dict[str, tuple[str, Any]] = {
    "prompt": ("str", ...),
    "negative_prompt": ("str", _OPTIONAL),
    "seed": ("int", _OPTIONAL),
    "generator_device": ("str", "cuda"),  # our noise is drawn on the CPU whatever the device
    "width": ("int", _OPTIONAL),
    "height": ("int", _OPTIONAL),
    "num_inference_steps": ("int", _OPTIONAL),
    "num_outputs_per_prompt": ("int", _OPTIONAL),
    "guidance_scale": ("float", _OPTIONAL),
    "true_cfg_scale": ("float", _OPTIONAL),
    "num_frames": ("int", _OPTIONAL),
    "fps": ("int", _OPTIONAL),  # read and bounded, not used: frames are returned, not a video file
    "rollout": ("bool", True),
    "rollout_sde_type": ("str", "sde"),
    "rollout_noise_level": ("float", 0.7),
    "rollout_log_prob_no_const": ("bool", False),
    "rollout_debug_mode": ("bool", False),  # SGLang's model: True (see the module docstring)
    "rollout_return_denoising_env": ("bool", False),
    "rollout_return_dit_trajectory": ("bool", False),
    "rollout_sde_step_indices": ("ints", _OPTIONAL),
    "rollout_return_step_indices": ("ints", _OPTIONAL),
    "image_path": ("strs", _OPTIONAL),  # refused: a client names no file of the server's
    "suppress_logs": ("bool", False),  # read, not used: the one log line per rollout stays
    "extra_sampling_params": ("dict", _OPTIONAL),
    # Ours, as SGLang's LLM runtime names a request's id: the id /abort_request names (rollout_id).
    "rid": ("str", _OPTIONAL),
}
# The fields above that are read and not used: reported as ignored when set to other than their default.
_UNUSED_FIELDS = ("generator_device", "fps", "suppress_logs")
# SGLang's SamplingParams fields that extra_sampling_params may set besides the RolloutRequest's: Wan
# 2.2's CFG scale of its low-noise expert and the boundary between its experts, our fields of the names.
SAMPLING_FIELDS: dict[str, tuple[str, Any]] = {
    "guidance_scale_2": ("float", _OPTIONAL),
    "boundary_ratio": ("float", _OPTIONAL),
}
# SamplingParams fields that change nothing this server returns (output files and their encoding, logs,
# profiling, SGLang's own frame rounding and sharding): read and ignored. So is ``rollout``, which
# SGLang takes from the body whatever extra_sampling_params says.
IGNORED_SAMPLING_FIELDS = frozenset(
    {
        "rollout",
        "save_output",
        "output_path",
        "output_file_name",
        "output_quality",
        "output_compression",
        "x264_preset",
        "return_frames",
        "return_file_paths_only",
        "return_image_bytes",
        "return_trajectory_latents",
        "return_trajectory_decoded",
        "profile",
        "num_profiled_timesteps",
        "profile_all_stages",
        "debug",
        "perf_dump_path",
        "no_override_protected_fields",
        "adjust_frames",
        "num_frames_round_down",
        "enable_sequence_shard",
    }
)
_NOT_SERVED = (
    "is not served: extra_sampling_params takes the RolloutRequest fields, seed as a list, "
    "guidance_scale_2 and boundary_ratio, and ignores output and logging options (docs/sglang-compat.md)"
)
# JSON and msgpack integers are unbounded: an integer field takes the range of the proto field it
# becomes, uint32 (a list's items too), the seed a uint64; fps, which becomes none, a frame rate.
_UINT32 = (0, 2**32 - 1)
_INT_RANGES = {"seed": (0, _MAX_SEED), "fps": (1, _MAX_FPS), "policy_version": (0, MAX_POLICY_VERSION)}
_MAX_LIST = 1024


@dataclass(frozen=True)
class GenerateRequest:
    """One ``POST /rollout/generate`` body, read and typed (``values`` by SGLang field name, ``seeds``
    the explicit per-sample seeds of a list), with the names of the fields it set that are not used."""

    values: dict[str, Any]
    ignored: tuple[str, ...] = ()
    seeds: tuple[int, ...] | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def samples(self) -> int:
        return self.num_outputs_per_prompt or 1


_EXPECTED = {
    "str": "a string",
    "bool": "true or false",
    "int": "an integer",
    "float": "a finite number",
    "ints": f"a list of at most {_MAX_LIST} integers",
    "strs": f"a list of at most {_MAX_LIST} strings",
    "dict": "an object",
}
_TYPES = {"str": str, "bool": bool, "int": int, "float": int | float, "dict": dict}


def _is_kind(kind: str, value: Any) -> bool:
    """Whether ``value`` has the type of ``kind`` (a float field takes an integer too; a bool is not
    a number)."""
    if kind in ("ints", "strs"):
        return (
            isinstance(value, list) and len(value) <= _MAX_LIST and all(_is_kind(kind[:-1], v) for v in value)
        )
    return isinstance(value, _TYPES[kind]) and (kind == "bool" or not isinstance(value, bool))


def _value_problem(kind: str, value: Any, bounds: tuple[int, int]) -> str | None:
    """What is wrong with ``value``, of ``kind``'s type, as a value (None: nothing): an integer outside
    ``bounds``, a number no float holds, a string that is not Unicode (JSON's \\ud800 escapes decode
    to lone surrogates, which neither a protobuf nor an answer can carry)."""
    if kind in ("ints", "strs"):
        problems = ((i, _value_problem(kind[:-1], v, bounds)) for i, v in enumerate(value))
        return next((f"item {i} {problem}" for i, problem in problems if problem), None)
    if kind == "int" and not bounds[0] <= value <= bounds[1]:
        return f"must be an integer in [{bounds[0]}, {bounds[1]}]"
    if kind == "float" and not math.isfinite(_as_float(value)):
        return "must be a finite number"
    if kind == "str" and not _is_unicode(value):
        return "must be valid Unicode: it holds a lone surrogate"
    return None


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        return math.inf


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _read_fields(body: dict, fields: dict[str, tuple[str, Any]]) -> tuple[dict[str, Any], list]:
    """(values by name, violations) of ``body`` read as ``fields``: (type, default), where the
    default ``...`` makes a field required and None lets it be null. An integer must lie in the
    field's range (``_INT_RANGES``, uint32 by default)."""
    values, violations = {}, []
    for name, (kind, default) in fields.items():
        value = body.get(name, default)
        if value is ...:
            violations.append((name, "is required"))
        elif value is None and default is _OPTIONAL:
            values[name] = None
        elif not _is_kind(kind, value):
            violations.append((name, f"must be {_EXPECTED[kind]}" + (" or null" if default is None else "")))
        elif problem := _value_problem(kind, value, _INT_RANGES.get(name, _UINT32)):
            violations.append((name, problem))
        else:
            values[name] = float(value) if kind == "float" else value
    return values, violations


def read_request(body: Any, max_samples: int) -> GenerateRequest:
    """The typed request of a decoded body; InvalidRequest naming every field that is wrong. Keys SGLang
    does not know are ignored, as its model ignores them (and named in ``ignored``);
    ``extra_sampling_params`` is read by ``_read_extra``. ``num_outputs_per_prompt`` is bounded by the
    server's ``max_samples`` here, before a seed is expanded into one per sample."""
    if not isinstance(body, dict):
        raise InvalidRequest([("request", "the body must be a JSON or msgpack object")])
    extra = body.get("extra_sampling_params")
    merged, sampling, seeds, ignored, violations = _read_extra(extra if isinstance(extra, dict) else {})
    ignored = [_key_name(key) for key in body if key not in FIELDS] + ignored
    values, wrong = _read_fields({**body, **merged}, FIELDS)
    violations += wrong
    if not violations:
        violations += _value_problems(values, max_samples)
        if seeds is not None and len(seeds) != (values["num_outputs_per_prompt"] or 1):
            violations.append(
                ("extra_sampling_params.seed", "a list holds one seed per output: num_outputs_per_prompt")
            )
    if violations:
        raise InvalidRequest(violations)
    ignored += [name for name in _UNUSED_FIELDS if values[name] != FIELDS[name][1]]
    return GenerateRequest({**values, **sampling}, tuple(ignored), seeds)


def _read_extra(extra: dict) -> tuple[dict, dict, tuple[int, ...] | None, list[str], list]:
    """``extra_sampling_params`` read as SGLang merges it into its SamplingParams: (the RolloutRequest
    fields it sets, its SAMPLING_FIELDS typed, the seeds of a seed list, the ignored names, the
    violations), each of its fields named ``extra_sampling_params.<name>``."""
    merged, sampling, ignored, violations = {}, {}, [], []
    seeds = None
    for key, value in extra.items():
        name = f"extra_sampling_params.{_key_name(key)}"
        if key in IGNORED_SAMPLING_FIELDS:
            ignored.append(name)
        elif key == "seed" and isinstance(value, list):
            if not _is_kind("ints", value):
                violations.append((name, f"must be an integer or {_EXPECTED['ints']}"))
            elif problem := _value_problem("ints", value, _INT_RANGES["seed"]):
                violations.append((name, problem))
            else:
                seeds = tuple(value)
        elif key in FIELDS and key != "extra_sampling_params":
            merged[key] = value
        elif key in SAMPLING_FIELDS:
            sampling[key] = value
        else:
            violations.append((name, _NOT_SERVED))
    typed, wrong = _read_fields(sampling, {key: SAMPLING_FIELDS[key] for key in sampling})
    violations += [(f"extra_sampling_params.{field}", problem) for field, problem in wrong]
    return (
        merged,
        {key: value for key, value in typed.items() if value is not None},
        seeds,
        ignored,
        violations,
    )


def _key_name(key: str) -> str:
    """A client's key as a field name in answers, headers and logs: itself if a short ASCII identifier,
    else quoted and cut."""
    plain = isinstance(key, str) and key.isascii() and key.isidentifier() and len(key) <= 64
    return key if plain else quoted(str(key), 64)


def load_weights_request(body: Any, policy_version: int) -> rollout_pb2.LoadWeightsRequest:
    """LoadWeights for SGLang's ``update_weights_from_disk`` body: ``model_path`` under the server's
    --weights-root, at most one of ``target_modules`` (one transformer per update, so that an update
    applies whole or not at all), ``flush_cache`` read and not needed (a transformer update leaves
    the cached prompt encodings valid), and our ``policy_version`` (default: the served one + 1)."""
    if not isinstance(body, dict):
        raise InvalidRequest([("request", "the body must be a JSON or msgpack object")])
    fields = {
        "model_path": ("str", ...),
        "flush_cache": ("bool", True),
        "target_modules": ("strs", _OPTIONAL),
        "policy_version": ("int", _OPTIONAL),
    }
    values, violations = _read_fields(body, fields)
    if not violations and len(values["target_modules"] or ()) > 1:
        violations.append(("target_modules", "names one transformer per update (or none: the transformer)"))
    if violations:
        raise InvalidRequest(violations)
    version = values["policy_version"]
    return rollout_pb2.LoadWeightsRequest(
        policy_version=policy_version + 1 if version is None else version,
        path=values["model_path"],
        target=(values["target_modules"] or [""])[0],
    )


def checksum_modules(body: Any) -> list[str] | None:
    """The ``module_names`` of a ``get_weights_checksum`` body (None: every transformer)."""
    if not isinstance(body, dict):
        raise InvalidRequest([("request", "the body must be a JSON or msgpack object")])
    values, violations = _read_fields(body, {"module_names": ("strs", _OPTIONAL)})
    if violations:
        raise InvalidRequest(violations)
    return values["module_names"]


# What SGLang's LLM runtime names the memory a release or resume takes (``tags``); a diffusion server
# holds weights alone, and releases and resumes all of its memory whatever the tags say.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def memory_tags(body: Any) -> list[str] | None:
    """The ``tags`` of a ``release_memory_occupation`` or ``resume_memory_occupation`` body (SGLang's
    LLM runtime takes them, its diffusion runtime a body without fields): read and checked."""
    if not isinstance(body, dict):
        raise InvalidRequest([("request", "the body must be a JSON or msgpack object")])
    values, violations = _read_fields(body, {"tags": ("strs", _OPTIONAL)})
    if not violations and (unknown := [tag for tag in values["tags"] or () if tag not in MEMORY_TAGS]):
        violations.append(("tags", f"must name {', '.join(MEMORY_TAGS)}; not {quoted(unknown[0], 64)}"))
    if violations:
        raise InvalidRequest(violations)
    return values["tags"]


def abort_request(body: Any, max_id_chars: int) -> tuple[str, bool]:
    """(``rid``, ``abort_all``) of an ``abort_request`` body (SGLang's LLM runtime's ``AbortReq``; its
    other fields are ignored, as they describe its own scheduler's reasons)."""
    if not isinstance(body, dict):
        raise InvalidRequest([("request", "the body must be a JSON or msgpack object")])
    values, violations = _read_fields(body, {"rid": ("str", _OPTIONAL), "abort_all": ("bool", False)})
    if violations:
        raise InvalidRequest(violations)
    return rollout_id(values["rid"] or "", max_id_chars), values["abort_all"]


def rollout_id(rid: Any, max_chars: int) -> str:
    """A ``/rollout/generate`` body's ``rid`` (as SGLang's LLM runtime names a request's id; its
    diffusion runtime draws one): our request id, which ``/abort_request`` names. "" when unset."""
    if rid is None:
        return ""
    if not isinstance(rid, str) or len(rid) > max_chars or not rid.isprintable():
        raise InvalidRequest([("rid", f"must be a printable string of at most {max_chars} characters")])
    return rid


# The fields of an answer that carry a sample's outputs (None in an aborted rollout's answer).
_OUTPUT_FIELDS = (
    "generated_output",
    "rollout_log_probs",
    "rollout_debug_tensors",
    "denoising_env",
    "dit_trajectory",
    "peak_memory_mb",
)


def aborted_responses(
    request: GenerateRequest, resolved: rollout_pb2.RolloutRequest, seconds: float
) -> list[dict[str, Any]]:
    """The answer to a rollout stopped by ``/abort_request``: SGLang's response of every sample, with no
    output, and the finish reason SGLang's LLM runtime gives an aborted request (its diffusion runtime
    has no abort)."""
    reason = {"type": "abort", "message": "aborted by /abort_request"}
    return [
        {
            "request_id": resolved.request_id,
            "prompt": request.prompt,
            "seed": seed,
            **dict.fromkeys(_OUTPUT_FIELDS),
            "inference_time_s": seconds,
            "finish_reason": reason,
        }
        for seed in resolved.seeds
    ]


# Our update's fields (LoadWeights's, and a checked update's header) as SGLang's weight bodies name them.
_UPDATE_FIELDS = {
    "target": "target_modules",
    "header.target": "target_modules",
    "policy_version": "policy_version",
    "header.policy_version": "policy_version",
}
# SGLang's update_weights_from_tensor body (io_struct.UpdateWeightFromTensorReqInput) besides its
# serialized_named_tensors, and our policy_version; lora_rank is checked against the payload's.
TENSOR_UPDATE_FIELDS: dict[str, tuple[str, Any]] = {
    "load_format": ("str", _OPTIONAL),
    "target_modules": ("strs", _OPTIONAL),
    "weight_update_mode": ("str", _OPTIONAL),
    "lora_rank": ("int", _OPTIONAL),
    "lora_alpha": ("float", _OPTIONAL),
    "policy_version": ("int", _OPTIONAL),
}
# Fields trainers send that are read and not used: one payload needs no GPU to pick it by
# (payload_gpu_uuids), policy_version counts the updates (weight_version, which a trainer sends alike
# with each part of one update), and a transformer update leaves the cached prompt encodings valid
# (flush_cache).
UNUSED_TENSOR_UPDATE_FIELDS = ("payload_gpu_uuids", "weight_version", "flush_cache")
# weight_update_mode: SGLang's default (the tensors sent replace theirs), ours, SGLang's LoRA mode.
UPDATE_KINDS = {None: SUBSET, "full": FULL, "lora_merge": LORA}


def tensor_update(
    body: Any,
    current_version: int,
    max_bytes: int,
    transformers: Iterable[str],
    module_names: Callable[[str], Iterable[str]],
) -> tuple[WeightUpdate, list[str]]:
    """(the update, the fields set that are read and not used) of SGLang's ``update_weights_from_tensor``
    body: one payload of data (``weights.payload``) for at most one of ``transformers`` in
    ``target_modules``; ``weight_update_mode`` null for a SUBSET, ``"full"`` for a FULL update, or
    ``"lora_merge"`` for a LoRA adapter (``module_names(target)``: the transformer's modules); and our
    ``policy_version`` (default: ``current_version`` + 1). InvalidRequest naming the body's fields,
    StaleUpdate for a version not above ``current_version``; the version and target are checked before
    the payload is decoded."""
    if not isinstance(body, dict):
        raise InvalidRequest([("request", "the body must be a JSON or msgpack object")])
    values, violations = _read_fields(body, TENSOR_UPDATE_FIELDS)
    payloads = body.get(payload.FIELD)
    if not (isinstance(payloads, list) and len(payloads) == 1):
        violations.append(
            (
                payload.FIELD,
                "must be a list of one payload: the server keeps one copy of the weights (its "
                "sequence-parallel ranks get theirs from rank 0)",
            )
        )
    if values.get("load_format") not in (None, *payload.LOAD_FORMATS):
        violations.append(("load_format", f"must be null or one of {', '.join(payload.LOAD_FORMATS)}"))
    if values.get("weight_update_mode") not in UPDATE_KINDS:
        violations.append(("weight_update_mode", "must be null, full or lora_merge"))
    if len(values.get("target_modules") or ()) > 1:
        violations.append(("target_modules", "names one transformer per update (or none: the transformer)"))
    if values.get("lora_rank") is not None and not 1 <= values["lora_rank"] <= MAX_RANK:
        violations.append(("lora_rank", f"must be in [1, {MAX_RANK}]"))
    if violations:
        raise InvalidRequest(violations)
    target = (values["target_modules"] or ["transformer"])[0]
    check_target(target, transformers, "target_modules")
    version = current_version + 1 if values["policy_version"] is None else values["policy_version"]
    check_version(version, current_version)
    kind = UPDATE_KINDS[values["weight_update_mode"]]
    load_format = values["load_format"] or payload.SAFETENSORS
    # Taken out of the body (no reference left here), so that its text is freed once decoded.
    tensors, nbytes = payload.decode(payloads.pop(), load_format, target, max_bytes)
    config = ""
    if kind == LORA:
        tensors, config = payload.lora_adapter(
            tensors, values["lora_rank"], values["lora_alpha"], module_names(target)
        )
    update = WeightUpdate(version, kind, tensors, nbytes, lora_config_json=config, target=target)
    unused = [name for name in UNUSED_TENSOR_UPDATE_FIELDS if body.get(name) is not None]
    if kind != LORA:  # as SGLang, the LoRA fields matter in lora_merge alone
        unused += [name for name in ("lora_rank", "lora_alpha") if values[name] is not None]
    return update, unused


def checker_request(body: Any) -> tuple[str, dict[str, str]]:
    """(the module, the expected SHA-256 by tensor name, in lower case) of SGLang's
    ``update_weights_from_tensor_checker`` body."""
    if not isinstance(body, dict):
        raise InvalidRequest([("request", "the body must be a JSON or msgpack object")])
    fields = {"target_module": ("str", ...), "expected_named_tensors_sha256": ("dict", ...)}
    values, violations = _read_fields(body, fields)
    expected = values.get("expected_named_tensors_sha256")
    if expected is not None:
        wrong = next((name for name, digest in expected.items() if not _is_sha256(name, digest)), None)
        if not expected:
            violations.append(("expected_named_tensors_sha256", "must name at least one tensor"))
        elif wrong is not None:
            violations.append(
                (
                    "expected_named_tensors_sha256",
                    f"{quoted(str(wrong))}: must map a tensor name to its SHA-256 in 64 hex digits",
                )
            )
    if violations:
        raise InvalidRequest(violations)
    return values["target_module"], {name: digest.lower() for name, digest in expected.items()}


def _is_sha256(name: Any, digest: Any) -> bool:
    return (
        isinstance(name, str)
        and _is_unicode(name)
        and isinstance(digest, str)
        and len(digest) == 64
        and all(c in string.hexdigits for c in digest)
    )


def quoted_reason(error: Exception) -> str:
    """A parse error, bounded and escaped for an answer and the log."""
    return quoted(f"{type(error).__name__}: {error}")


def _value_problems(values: dict[str, Any], max_samples: int) -> list[tuple[str, str]]:
    problems = []
    if values["rollout_sde_type"] not in SDE_TYPES:
        problems.append(("rollout_sde_type", f"must be one of {', '.join(SDE_TYPES)}"))
    elif (
        values["rollout"] and values["rollout_sde_type"] == "ode" and not values["rollout_log_prob_no_const"]
    ):
        # SGLang's own rule: an ODE step has no density, so a log-prob with constants means nothing.
        problems.append(("rollout_log_prob_no_const", "must be true with rollout_sde_type ode"))
    if len(values["generator_device"]) > _MAX_SHORT_STRING:
        problems.append(("generator_device", f"must be at most {_MAX_SHORT_STRING} characters"))
    if values["image_path"]:
        problems.append(
            (
                "image_path",
                "is not served: a client names no file on the server; send conditioning images with "
                "the gRPC Rollout's condition_images",
            )
        )
    samples = values["num_outputs_per_prompt"]
    if samples is not None and not 1 <= samples <= max_samples:
        problems.append(
            ("num_outputs_per_prompt", f"must be in [1, {max_samples}] (the server's --max-samples)")
        )
    seed = values["seed"]
    if seed is not None and seed > _MAX_SEED - (samples or 1) + 1:
        problems.append(("seed", "must be in [0, 2^64 - num_outputs_per_prompt]: samples take seed + k"))
    return problems


def to_rollout_request(
    request: GenerateRequest, request_id: str, serving: "ServingContext"
) -> tuple[rollout_pb2.RolloutRequest, tuple[str, ...]]:
    """Our RolloutRequest for a typed SGLang request (validated by ``resolve`` as any other), and the
    names of the fields it set that are not used: ``request.ignored``, then ``_unread``'s."""
    ours = rollout_pb2.RolloutRequest(request_id=request_id, prompts=[request.prompt])
    unread = _unread(request, serving)
    if request.negative_prompt is not None and "negative_prompt" not in unread:
        ours.negative_prompt = request.negative_prompt
    if request.num_outputs_per_prompt is not None:
        ours.samples_per_prompt = request.num_outputs_per_prompt
    if request.seeds is not None:
        ours.seeds.extend(request.seeds)
    elif request.seed is not None:
        ours.seeds.extend(request.seed + k for k in range(request.samples))
    for theirs, field in (
        ("height", "height"),
        ("width", "width"),
        ("num_inference_steps", "num_steps"),
        ("guidance_scale", "guidance_scale"),
        ("true_cfg_scale", "true_cfg_scale"),
        ("num_frames", "num_frames"),
        *((name, name) for name in SAMPLING_FIELDS),
    ):
        if (value := request.values.get(theirs)) is not None and theirs not in unread:
            setattr(ours, field, value)
    stochastic = request.rollout and request.rollout_sde_step_indices != []
    ours.sampler = SDE_TYPES[request.rollout_sde_type] if stochastic else rollout_pb2.SAMPLER_TYPE_ODE
    if ours.sampler != rollout_pb2.SAMPLER_TYPE_ODE:
        ours.noise_level = request.rollout_noise_level
        ours.log_prob_constants = not request.rollout_log_prob_no_const
        if request.rollout_sde_step_indices:
            ours.stochastic_steps.extend(sorted(set(request.rollout_sde_step_indices)))
    wants_latents = request.rollout and request.rollout_return_dit_trajectory
    ours.latents = rollout_pb2.LATENT_SELECTION_ALL if wants_latents else rollout_pb2.LATENT_SELECTION_NONE
    if request.rollout and request.rollout_debug_mode:
        ours.debug_tensors.extend(_DEBUG_TENSORS)
    ours.images = True
    return ours, (*request.ignored, *(SGLANG_NAMES.get(field, field) for field in unread))


def _unread(request: GenerateRequest, serving: "ServingContext") -> list[str]:
    """The fields of ``request`` that SGLang takes for every model and the served one does not read: a
    CFG or guidance scale it has no use for (SGLang passes both to every pipeline), the negative prompt
    while CFG is off (the model's CFG scale, as set or by default, at or below its off value), the
    second expert's fields on a model with one (or its scale while CFG is off), and the body's seed
    where extra_sampling_params gives a list (which SGLang merges over it)."""
    values, model = request.values, serving.model
    unread = [
        field for field in SCALE_FIELDS if values[field] is not None and field not in model.scale_fields
    ]
    scale = values[model.cfg_scale_field]
    if scale is None or model.cfg_scale_field in unread:
        scale = getattr(serving.defaults, model.cfg_scale_field)
    cfg = serving.has_cfg and scale > model.cfg_off_scale
    if request.negative_prompt and not cfg:
        unread.append("negative_prompt")
    experts = model.boundary_ratio is not None
    unread += [
        field
        for field in SAMPLING_FIELDS
        if field in values and (not experts or (field == "guidance_scale_2" and not cfg))
    ]
    if request.seeds is not None and request.seed is not None:
        unread.append("seed")
    return unread


def ignored_summary(names: tuple[str, ...]) -> str:
    """``names`` for the ignored-fields header and its log line: comma-separated, at most
    ``_MAX_IGNORED_NAMED`` of them, then a count of the rest. A client's key that is not a plain
    identifier is counted, not named: a header carries ASCII and a log line no client text."""
    named = [name for name in names if name.isascii() and all(p.isidentifier() for p in name.split("."))]
    shown = named[:_MAX_IGNORED_NAMED]
    rest = len(names) - len(shown)
    return ",".join(shown + ([f"+{rest} more"] if rest else []))


def sglang_violations(error: InvalidRequest) -> list[dict[str, str]]:
    """The violations of a rejected rollout request, each under the SGLang field the client set."""
    return [
        {"field": SGLANG_NAMES.get(field.split("[")[0].split(".")[0], field), "description": description}
        for field, description in error.violations
    ]


def weight_violations(
    error: InvalidRequest, weights_field: str, body_fields: Iterable[str] = ()
) -> list[dict[str, str]]:
    """The violations of a rejected weight update, each under the field of its SGLang body it
    concerns: ``target_modules`` and ``policy_version`` for the update's target and version, the
    ``body_fields`` (and the parts of them) as they are, and ``weights_field`` for everything else about
    the weights (for ``update_weights_from_disk``, ``model_path``: LoadWeights's path, kind and the
    tensors, adapter config and sizes read from it)."""
    body_fields = {weights_field, *body_fields}

    def named(field: str) -> str:
        whole = field.split("[")[0].split(".")[0] in body_fields
        return _UPDATE_FIELDS.get(field, field if whole else weights_field)

    return [{"field": named(field), "description": description} for field, description in error.violations]


def returned_steps(request: GenerateRequest, num_steps: int) -> list[int]:
    """The latents a response carries, by step index (0 .. T, T the final latent); InvalidRequest for
    an index past T."""
    if not (request.rollout and request.rollout_return_dit_trajectory):
        return []
    indices = request.rollout_return_step_indices
    if indices is None:
        return list(range(num_steps + 1))
    if indices and max(indices) > num_steps:
        raise InvalidRequest(
            [("rollout_return_step_indices", f"step indices go from 0 to num_inference_steps ({num_steps})")]
        )
    return sorted(set(indices))


def response_bound(
    request: GenerateRequest, resolved: rollout_pb2.RolloutRequest, sizes: "SampleSizes"
) -> int:
    """An upper bound on the bytes of the whole answer to ``request`` (resolved as ``resolved``), from
    one sample's sizes: every tensor at float32 (step indices int64), with room for keys."""
    steps = resolved.num_steps
    frames = resolved.num_frames or 1
    latent_bytes = sizes.latent_elements * 4
    per_sample = 3 * frames * resolved.height * resolved.width * 4  # generated_output
    if request.rollout:
        per_sample += 4 * steps  # rollout_log_probs
        returned = len(returned_steps(request, steps))
        per_sample += returned * (latent_bytes + 4 + 8) + 4 * (steps + 1)  # latents, timesteps, indices
        if sizes.latent_streams:  # each stream's latents, indices and whole schedule again
            per_sample += returned * latent_bytes + sizes.latent_streams * (8 * returned + 8 * (steps + 1))
        if request.rollout_debug_mode:
            per_sample += steps * (3 * latent_bytes + 4)
        if request.rollout_return_denoising_env:
            per_sample += 2 * sizes.text_bytes  # both CFG branches
    return len(resolved.seeds) * (per_sample + _RESPONSE_OVERHEAD_BYTES)


def tensor(value: torch.Tensor) -> dict[str, Any]:
    """SGLang's tensor form: the safetensors bytes of ``{"t": value}``, with its shape and dtype."""
    value = value.detach().contiguous().cpu()
    return {
        "__tensor__": True,
        "data": save({"t": value}),
        "shape": list(value.shape),
        "dtype": str(value.dtype),
    }


def _encodable(value: Any) -> Any:
    """An env value as msgpack carries it: tensors in SGLang's form, tuples as lists."""
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, dict):
        return {key: _encodable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(item) for item in value]
    return value


class RolloutAnswer:
    """The events of one ``/rollout/generate`` rollout (``engine.RolloutEvents``), kept as the engine
    produces them for ``responses``: every sample's latents x_0 .. x_T (when the request returns them,
    at the stream's latent dtype, held as float32), each step's log-probs and debug tensors, each
    sample's frames (RGB) and the finished event. Made on the worker thread by ``events_of``;
    ``emit`` gets the answer itself once the rollout has finished."""

    def __init__(
        self,
        request: rollout_pb2.RolloutRequest,
        started: rollout_pb2.RolloutStarted,
        env_tensors: dict[str, torch.Tensor],
        emit: Callable[["RolloutAnswer"], None],
    ):
        self.request, self.started, self.env_tensors, self.emit = request, started, env_tensors, emit
        samples, num_steps = len(started.seeds), len(started.stochastic)
        shape = tuple(started.layout.shape)
        self.latent_dtype = dtypes.LATENT[request.latent_dtype]
        self.latents = None
        if request.latents == rollout_pb2.LATENT_SELECTION_ALL:  # what the front end asks for, or none
            self.latents = torch.full((samples, num_steps + 1, *shape), float("nan"))
        self.log_probs = torch.full((samples, num_steps), float("nan"))
        # SGLang's debug tensors, [samples, T, ...]: 0 where a step has none (eps and sd when deterministic).
        self.debug = {}
        if request.debug_tensors:
            self.debug = {
                EPS: torch.zeros(samples, num_steps, *shape),
                MEAN: torch.zeros(samples, num_steps, *shape),
                SD: torch.zeros(samples, num_steps),
                VELOCITY: torch.zeros(samples, num_steps, *shape),
            }
        self.frames: dict[int, dict[int, numpy.ndarray]] = {}  # sample -> frame -> RGB
        self.finished: rollout_pb2.RolloutFinished | None = None

    def on_start(self, x0: torch.Tensor) -> None:
        if self.latents is not None:
            self.latents[:, 0] = x0.to(self.latent_dtype)  # a copy, in float32

    def on_step(self, record, nodes: list[int]) -> None:
        i = record.index
        if self.latents is not None:
            self.latents[:, i + 1] = record.x_next.to(self.latent_dtype)
        if record.log_probs is not None:
            self.log_probs[:, i] = record.log_probs
        if self.debug:
            if record.eps is not None:
                self.debug[EPS][:, i] = record.eps
            self.debug[SD][:, i] = record.sd.expand(len(self.log_probs)).float()
            self.debug[MEAN][:, i] = record.mean
            self.debug[VELOCITY][:, i] = record.velocity

    def on_pruned(self, nodes: list[int], step: int) -> None:  # a tree's: no SGLang request makes one
        pass

    def on_image(self, sample_index: int, frame_index: int, image) -> None:
        self.frames.setdefault(sample_index, {})[frame_index] = numpy.asarray(image.convert("RGB"))

    def on_audio(self, sample_index: int, sound) -> None:  # SGLang's answer carries no sound
        pass

    def on_preview(self, step: int, sample_index: int, frame_index: int, media, last: bool) -> None:
        pass  # no SGLang request asks for previews

    def on_finish(self, finished: rollout_pb2.RolloutFinished) -> None:
        self.finished = finished
        self.emit(self)

    def env(self) -> dict[str, list[dict[str, Any]]]:
        """env[branch][prompt] as the started event names it: its tensors, then its other values."""
        envs = wire.decode_env(self.env_tensors, self.started.env_json)
        return {branch: [per_prompt[p] for p in sorted(per_prompt)] for branch, per_prompt in envs.items()}


# The debug tensors of a RolloutAnswer, by SGLang's names.
EPS, MEAN, SD, VELOCITY = (
    "rollout_variance_noises",
    "rollout_prev_sample_means",
    "rollout_noise_std_devs",
    "rollout_model_outputs",
)


def _generated_output(frames: dict[int, numpy.ndarray] | None) -> dict[str, Any] | None:
    """The decoded sample as float32 in [0, 1]: [3, H, W], or [3, F, H, W] for several frames."""
    if not frames:
        return None
    pixels = torch.stack([torch.from_numpy(frames[f]) for f in sorted(frames)]).permute(3, 0, 1, 2)
    pixels = pixels.float() / 255  # [3, F, H, W]
    return tensor(pixels[:, 0] if len(frames) == 1 else pixels)


def _text_length(env: dict[str, Any], key: str) -> int:
    """The valid text tokens of a branch whose text states are ``env[key]`` ([1, tokens, width]), by
    its mask where it has one (Qwen-Image's; None when all are valid)."""
    mask = env.get("encoder_hidden_states_mask")
    return int(mask.sum()) if mask is not None else env[key].shape[1]


def _txt_seq_lens(env: dict[str, Any]) -> dict[str, Any]:
    return {"txt_seq_lens": [_text_length(env, "encoder_hidden_states")]}


def _caption_valid_lens(env: dict[str, Any]) -> dict[str, Any]:
    return {"caption_valid_lens": torch.tensor([_text_length(env, "cap_feats")])}


# The cond kwargs that SGLang's own pipeline configs put in a family's env besides ours, computed from
# ours: Qwen-Image's text lengths (QwenImagePipelineConfig's list) and Z-Image's (ZImagePipelineConfig's
# long tensor). The diffusers call does not take them: the env names them in ``sglang_keys``. SGLang's
# rotary caches (freqs_cis) are not sent: a transformer computes them from these.
SGLANG_ENV = {"qwen-image": _txt_seq_lens, "qwen-image-edit": _txt_seq_lens, "z-image": _caption_valid_lens}


def _denoising_env(
    env: dict[str, dict[str, Any]], call: TransformerCall, step_transformers: list[str], family: str
) -> dict[str, Any]:
    branches = {branch: dict(kwargs) for branch, kwargs in env.items()}
    image_kwargs = {}
    key = call.conditioning.env_key
    if key:
        for env in branches.values():
            if key in env:
                image_kwargs[key] = env.pop(key)
    sglang_keys = set()
    if family in SGLANG_ENV:
        for env in branches.values():
            added = SGLANG_ENV[family](env)
            env.update(added)
            sglang_keys.update(added)
    return {
        "image_kwargs": _encodable(image_kwargs) if image_kwargs else None,
        "pos_cond_kwargs": _encodable(branches["positive"]),
        "neg_cond_kwargs": _encodable(branches["negative"]) if "negative" in branches else None,
        "guidance": _encodable(branches["positive"].get("guidance")),
        "transformer_call": json.loads(call.to_json()),
        "step_transformers": step_transformers,
        "sglang_keys": sorted(sglang_keys),
    }


def _stream_trajectories(
    latents: torch.Tensor,
    streams: tuple[latent_streams.LatentStream, ...],
    indices: list[int],
    timesteps: torch.Tensor,
    sigmas: torch.Tensor,
) -> dict[str, Any] | None:
    """Each latent stream of a sample that carries several (LTX-2: "video", "audio") as the multi-stream
    contract of SGLang's post-training API names them: its latents [K, *its shape] at
    ``latent_step_indices``, and the whole schedule (``timesteps`` and ``sigmas``, T + 1 each)."""
    if not streams:
        return None
    steps = torch.tensor(indices, dtype=torch.int64)
    split = latent_streams.split(latents, streams)
    return {
        stream.name: {
            "latents": tensor(stream_latents[indices]),
            "latent_step_indices": tensor(steps),
            "timesteps": tensor(timesteps),
            "sigmas": tensor(sigmas),
        }
        for stream, stream_latents in zip(streams, split, strict=True)
    }


def responses(
    answer: RolloutAnswer, request: GenerateRequest, inference_seconds: float
) -> list[dict[str, Any]]:
    """SGLang's ``RolloutResponse`` of every sample (as dicts) from a finished rollout's events."""
    started = answer.started
    resolved = started.resolved
    num_steps = len(started.stochastic)
    call = TransformerCall.from_proto(started.transformer_call)
    sigmas = torch.tensor(list(started.sigmas), dtype=torch.float32)
    timesteps = torch.tensor(list(started.timesteps), dtype=torch.float32)
    stochastic = torch.tensor(list(started.stochastic), dtype=torch.bool)
    peak_bytes = answer.finished.peak_memory_bytes
    env = answer.env() if request.rollout and request.rollout_return_denoising_env else {}
    indices = returned_steps(request, num_steps)
    answers = []
    for row, (seed, p) in enumerate(zip(started.seeds, started.prompt_indices, strict=True)):
        response = {
            "request_id": resolved.request_id,
            "prompt": resolved.prompts[p],
            "seed": seed,
            "generated_output": _generated_output(answer.frames.get(row)),
            "rollout_log_probs": None,
            "rollout_debug_tensors": None,
            "denoising_env": None,
            "dit_trajectory": None,
            "stream_trajectories": None,
            "inference_time_s": inference_seconds,
            "peak_memory_mb": peak_bytes / 2**20 if peak_bytes else None,
        }
        if request.rollout:
            response["rollout_log_probs"] = tensor(
                torch.where(stochastic, answer.log_probs[row], torch.zeros(()))
            )
            if request.rollout_debug_mode:
                response["rollout_debug_tensors"] = {
                    name: tensor(values[row]) for name, values in answer.debug.items()
                }
            if request.rollout_return_denoising_env:
                sample_env = {branch: per_prompt[p] for branch, per_prompt in env.items()}
                response["denoising_env"] = _denoising_env(
                    sample_env, call, list(started.step_transformers), started.family
                )
            if indices:
                latents = answer.latents[row]
                response["dit_trajectory"] = {
                    "latents": tensor(latents[indices]),
                    "timesteps": tensor(timesteps[indices]),
                    "sigmas": tensor(sigmas),
                    "latent_step_indices": tensor(torch.tensor(indices, dtype=torch.int64)),
                    "step_indices": indices,
                }
                response["stream_trajectories"] = _stream_trajectories(
                    latents, call.form.streams, indices, timesteps, sigmas
                )
        answers.append(response)
    return answers
