r"""SGLang-Diffusion's rollout API on our engine: its ``RolloutRequest`` read into ours, and a finished
rollout written back as its list of ``RolloutResponse`` (one per sample).

The fields and their meanings follow SGLang's released package (``sglang.multimodal_gen.runtime.
entrypoints.post_training``); where ours differ, the request is mapped as follows
(docs/sglang-compat.md has the whole table):

* ``rollout_sde_type`` sde, cps, ode -> FLOW_SDE, CPS, ODE; ``rollout=False`` (evaluation) -> ODE with
  no trajectory; ``rollout_sde_step_indices`` -> ``stochastic_steps`` (any order, repeats ignored; an
  empty list leaves no stochastic step, so ODE); ``rollout_log_prob_no_const`` -> not
  ``log_prob_constants`` (SGLang's default, constants included, for CPS too).
* ``seed`` s with ``num_outputs_per_prompt`` n -> the explicit seeds s, s + 1, .. s + n - 1, as SGLang
  numbers its outputs; each response carries its own sample's seed. Without a seed the server draws
  a base seed, and each response still names its sample's seed.
* ``rollout_debug_mode``: SGLang's model defaults it to true, which multiplies the payload by four;
  a body that leaves it out gets false here.

A response's tensors: ``rollout_log_probs`` float32 [T], 0 at deterministic steps as in SGLang;
``dit_trajectory.latents`` [K, ...] at ``step_indices`` (0 .. T, T the final latent; all of them unless
``rollout_return_step_indices``), with ``timesteps`` [K] and ``sigmas`` [T + 1]; ``denoising_env``
with each CFG branch's whole transformer call besides hidden_states and timestep (``pos_cond_kwargs``,
``neg_cond_kwargs``; the embedded ``guidance`` repeated apart, as SGLang reports it; an
image-conditioned family's conditioning latents in ``image_kwargs``) and ``transformer_call`` (how to
feed the timestep and combine the branches); ``generated_output``
the decoded sample, float32 in [0, 1], [3, H, W] for an image and [3, F, H, W] for a video.
"""

import io
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from PIL import Image
from safetensors.torch import save

from rollout.v1 import rollout_pb2
from rollout_client.events import Finished, Step, decode_stream
from rollout_client.trajectory import Collector, Trajectory
from rollout_core import wire
from rollout_server.errors import InvalidRequest
from rollout_server.limits import MAX_POLICY_VERSION
from rollout_server.validation import quoted

SDE_TYPES = {
    "sde": rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
    "cps": rollout_pb2.SAMPLER_TYPE_CPS,
    "ode": rollout_pb2.SAMPLER_TYPE_ODE,
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
}

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
    "suppress_logs": ("bool", False),
    "extra_sampling_params": ("dict", _OPTIONAL),
}
# JSON and msgpack integers are unbounded: an integer field takes the range of the proto field it
# becomes, uint32 (a list's items too), the seed a uint64; fps, which becomes none, a frame rate.
_UINT32 = (0, 2**32 - 1)
_INT_RANGES = {"seed": (0, _MAX_SEED), "fps": (1, _MAX_FPS), "policy_version": (0, MAX_POLICY_VERSION)}
_MAX_LIST = 1024


@dataclass(frozen=True)
class GenerateRequest:
    """One ``POST /rollout/generate`` body, read and typed (``values`` by SGLang field name)."""

    values: dict[str, Any]

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
    """The typed request of a decoded body; InvalidRequest naming every field that is wrong. Fields
    SGLang does not know are ignored, as its model ignores them; ``extra_sampling_params`` may set any
    of the known ones (SGLang merges it over them), and nothing else. ``num_outputs_per_prompt`` is
    bounded by the server's ``max_samples`` here, before a seed is expanded into one per sample."""
    if not isinstance(body, dict):
        raise InvalidRequest([("request", "the body must be a JSON or msgpack object")])
    merged = dict(body)
    violations = []
    extra = body.get("extra_sampling_params")
    if isinstance(extra, dict):
        unknown = sorted(
            quoted(str(key), 64)
            for key in extra
            if key not in FIELDS or key in ("rollout", "extra_sampling_params")
        )
        if unknown:
            violations.append(
                ("extra_sampling_params", f"takes RolloutRequest fields only; not {', '.join(unknown[:8])}")
            )
        else:
            merged.update(extra)
    values, wrong = _read_fields(merged, FIELDS)
    violations += wrong
    if not violations:
        violations += _value_problems(values, max_samples)
    if violations:
        raise InvalidRequest(violations)
    return GenerateRequest(values)


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


def to_rollout_request(request: GenerateRequest, request_id: str) -> rollout_pb2.RolloutRequest:
    """Our RolloutRequest for a typed SGLang request (validated by ``resolve`` as any other)."""
    ours = rollout_pb2.RolloutRequest(request_id=request_id, prompts=[request.prompt])
    if request.negative_prompt is not None:
        ours.negative_prompt = request.negative_prompt
    if request.num_outputs_per_prompt is not None:
        ours.samples_per_prompt = request.num_outputs_per_prompt
    if request.seed is not None:
        ours.seeds.extend(request.seed + k for k in range(request.samples))
    for theirs, field in (
        ("height", "height"),
        ("width", "width"),
        ("num_inference_steps", "num_steps"),
        ("guidance_scale", "guidance_scale"),
        ("true_cfg_scale", "true_cfg_scale"),
        ("num_frames", "num_frames"),
    ):
        if (value := request.values[theirs]) is not None:
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
    return ours


def sglang_violations(error: InvalidRequest) -> list[dict[str, str]]:
    """The violations of a rejected rollout request, each under the SGLang field the client set."""
    return [
        {"field": SGLANG_NAMES.get(field.split("[")[0].split(".")[0], field), "description": description}
        for field, description in error.violations
    ]


def weight_violations(error: InvalidRequest) -> list[dict[str, str]]:
    """The violations of a rejected ``update_weights_from_disk``, each under the field of its body it
    concerns: ``target_modules`` and ``policy_version`` for LoadWeights's target and version, and
    ``model_path`` for everything about what lies there (LoadWeights's path, kind and the tensors,
    adapter config and sizes read from it)."""
    names = {"target": "target_modules", "policy_version": "policy_version"}
    return [
        {"field": names.get(field, "model_path"), "description": description}
        for field, description in error.violations
    ]


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
    request: GenerateRequest, resolved: rollout_pb2.RolloutRequest, latent_elements: int, text_bytes: int
) -> int:
    """An upper bound on the bytes of the whole answer to ``request`` (resolved as ``resolved``), from
    one sample's latent elements and one text's env bytes: every tensor at float32, with room for keys."""
    steps = resolved.num_steps
    frames = resolved.num_frames or 1
    per_sample = 3 * frames * resolved.height * resolved.width * 4  # generated_output
    if request.rollout:
        per_sample += 4 * steps  # rollout_log_probs
        per_sample += len(returned_steps(request, steps)) * (latent_elements + 1) * 4 + 4 * (steps + 1)
        if request.rollout_debug_mode:
            per_sample += steps * (3 * latent_elements + 1) * 4
        if request.rollout_return_denoising_env:
            per_sample += 2 * text_bytes  # both CFG branches
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


def _generated_output(trajectory: Trajectory) -> dict[str, Any] | None:
    """The decoded sample as float32 in [0, 1]: [3, H, W], or [3, F, H, W] for several frames."""
    frames = [
        torch.from_numpy(numpy.asarray(Image.open(io.BytesIO(png)).convert("RGB")))
        for png in trajectory.frames_png
    ]
    if not frames:
        return None
    pixels = torch.stack(frames).permute(3, 0, 1, 2).float() / 255  # [3, F, H, W]
    return tensor(pixels[:, 0] if len(frames) == 1 else pixels)


def _denoising_env(trajectory: Trajectory) -> dict[str, Any]:
    call = trajectory.transformer_call
    branches = {branch: dict(env) for branch, env in trajectory.env.items()}
    image_kwargs = {}
    key = call.conditioning.env_key
    if key:
        for env in branches.values():
            if key in env:
                image_kwargs[key] = env.pop(key)
    return {
        "image_kwargs": _encodable(image_kwargs) if image_kwargs else None,
        "pos_cond_kwargs": _encodable(branches["positive"]),
        "neg_cond_kwargs": _encodable(branches["negative"]) if "negative" in branches else None,
        "guidance": _encodable(branches["positive"].get("guidance")),
        "transformer_call": json.loads(call.to_json()),
    }


def _debug(steps: list[Step], row: int, num_steps: int, shape: torch.Size) -> dict[str, Any]:
    """SGLang's debug tensors of one sample: [T, ...] per step (eps and sd 0 at deterministic steps)."""
    eps = torch.zeros(num_steps, *shape)
    mean = torch.zeros(num_steps, *shape)
    velocity = torch.zeros(num_steps, *shape)
    sd = torch.zeros(num_steps)
    for step in steps:
        debug = step.debug
        if wire.EPS in debug:
            eps[step.index] = debug[wire.EPS][row]
        if wire.SD in debug:
            sd[step.index] = debug[wire.SD][row]
        mean[step.index] = debug[wire.MEAN][row]
        velocity[step.index] = debug[wire.VELOCITY][row]
    return {
        "rollout_variance_noises": tensor(eps),
        "rollout_prev_sample_means": tensor(mean),
        "rollout_noise_std_devs": tensor(sd),
        "rollout_model_outputs": tensor(velocity),
    }


def responses(
    messages: list[rollout_pb2.RolloutResponse], request: GenerateRequest, inference_seconds: float
) -> list[dict[str, Any]]:
    """SGLang's ``RolloutResponse`` of every sample (as dicts) from a finished rollout's messages."""
    collector = Collector()
    steps = []
    peak_bytes = 0
    for event in decode_stream(messages):
        collector.add(event)
        if isinstance(event, Step) and event.debug:
            steps.append(event)
        elif isinstance(event, Finished):
            peak_bytes = event.message.peak_memory_bytes
    message = collector.started.message
    num_steps, shape = len(message.stochastic), torch.Size(message.layout.shape)
    indices = returned_steps(request, num_steps)
    answers = []
    for row, trajectory in enumerate(collector.trajectories()):
        answer = {
            "request_id": trajectory.request_id,
            "prompt": trajectory.prompt,
            "seed": trajectory.seed,
            "generated_output": _generated_output(trajectory),
            "rollout_log_probs": None,
            "rollout_debug_tensors": None,
            "denoising_env": None,
            "dit_trajectory": None,
            "inference_time_s": inference_seconds,
            "peak_memory_mb": peak_bytes / 2**20 if peak_bytes else None,
        }
        if request.rollout:
            zeroed = torch.where(trajectory.stochastic, trajectory.log_probs, torch.zeros(()))
            answer["rollout_log_probs"] = tensor(zeroed)
            if request.rollout_debug_mode:
                answer["rollout_debug_tensors"] = _debug(steps, row, num_steps, shape)
            if request.rollout_return_denoising_env:
                answer["denoising_env"] = _denoising_env(trajectory)
            if indices:
                answer["dit_trajectory"] = {
                    "latents": tensor(trajectory.latents[indices]),
                    "timesteps": tensor(trajectory.timesteps[indices]),
                    "sigmas": tensor(trajectory.sigmas),
                    "step_indices": indices,
                }
        answers.append(answer)
    return answers
