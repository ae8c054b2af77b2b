"""The names of the wire, in one place: every tensor of a rollout stream and of a saved trajectory, the
env's layout, and the features a server lists in GetServerInfo.

Stream tensors (one safetensors buffer per event):

* started: ``x_0`` [B, *layout.shape] (when the latent selection sends it) and the env tensors;
  a request's ``initial_latents`` is a buffer of ``x_0`` alone (``initial_latents_bytes``);
* step: ``x_next`` [B, *layout.shape] (when selected) and the requested debug tensors ``eps``,
  ``mean``, ``velocity`` [B, *layout.shape] and ``sd`` [B].

The env is named ``env/<branch>/<prompt index>/<kwarg>`` on the wire and in saved trajectories alike.
Its tensors travel in the buffer; its other values (None, booleans, lists) in one JSON document
``{"<branch>": {"<prompt index>": {"<kwarg>": value}}}``, where ``{"tensor": "<name>"}`` stands for a
tensor sent once for several entries.

A saved trajectory (one safetensors file per sample) holds ``sigmas``, ``timesteps``, ``stochastic``,
``latents``, ``latent_mask`` and ``log_probs``, its env (under its own prompt index) and its frames as
``frame_png/<j>``; with several latent streams (LTX-2), ``latents`` are the joint latents (their
streams are in the saved transformer call), each stream's own log-probs are
``stream_log_probs/<stream>``, and its sound is ``audio_wav``. Files written before the prompt index
was part of env names hold ``env/<branch>/<kwarg>``, and before frames, ``image_png``; both still load.
"""

import json
from collections.abc import Mapping
from typing import Any

import torch

from rollout.v1 import rollout_pb2

# Stream tensors.
X_0 = "x_0"
X_NEXT = "x_next"
EPS = "eps"
MEAN = "mean"
SD = "sd"
VELOCITY = "velocity"
# The debug tensors by rollout.v1 DebugTensor.
DEBUG_TENSORS = {
    rollout_pb2.DEBUG_TENSOR_EPS: EPS,
    rollout_pb2.DEBUG_TENSOR_MEAN: MEAN,
    rollout_pb2.DEBUG_TENSOR_SD: SD,
    rollout_pb2.DEBUG_TENSOR_VELOCITY: VELOCITY,
}

# Saved-trajectory tensors.
SIGMAS = "sigmas"
TIMESTEPS = "timesteps"
STOCHASTIC = "stochastic"
LATENTS = "latents"
LATENT_MASK = "latent_mask"
LOG_PROBS = "log_probs"
_FRAME_PREFIX = "frame_png/"
LEGACY_IMAGE_PNG = "image_png"  # the one image of files written before frames
CONDITION_IMAGE = "condition_image"  # the conditioning image file, as the client sent it
AUDIO_WAV = "audio_wav"  # the sample's sound, a WAV file
_STREAM_LOG_PROBS_PREFIX = "stream_log_probs/"

# GetServerInfo.features: the optional capabilities of a server, which a client checks for before it
# asks for one. Later servers add names; what a name means never changes.
FEATURE_LORA = "lora"  # weight updates take PEFT LoRA adapters (WEIGHTS_KIND_LORA)
FEATURE_LOAD_WEIGHTS = "load_weights"  # LoadWeights is served: the server has a --weights-root
FEATURE_VIDEO = "video"  # requests take num_frames > 1 (limits.max_frames, limits.frame_step)
FEATURE_EXPERTS = "experts"  # several transformers (Wan 2.2): steps name theirs, updates a target
FEATURE_TREE = "tree"  # requests take branches (tree rollouts), and PruneRollout is served
FEATURE_WEIGHT_SYNC = "weight_sync"  # InitWeightSync, UpdateWeightsFromGroup, DestroyWeightSync
FEATURE_CONDITION_IMAGES = "condition_images"  # requests carry a conditioning image per prompt
# Requests take prune_points (held there for the caller's prune); PruneRollout answers what it stopped
# and the step, and takes the rollout's control token.
FEATURE_PRUNE_POINTS = "prune_points"
# Requests take a trainer's schedule (sigmas) and x_0 (initial_latents); started echoes both.
FEATURE_SIGMAS = "sigmas"
FEATURE_INITIAL_LATENTS = "initial_latents"
# Samples carry several latent streams (transformer_call.streams; step events' stream_log_probs).
FEATURE_LATENT_STREAMS = "latent_streams"
# The stream sends each sample's sound (RolloutAudio events, WAV).
FEATURE_AUDIO = "audio"
# Two experts with a scale each (Wan 2.2): requests take guidance_scale_2, and transformer_call lists
# each step's scale (guidance_rule_scales).
FEATURE_GUIDANCE_SCALE_2 = "guidance_scale_2"
# Two experts: requests take their own boundary_ratio, where the second expert's steps begin.
FEATURE_BOUNDARY_RATIO = "boundary_ratio"
# ReleaseMemory and ResumeMemory are served: the weights' memory is released and resumed (sleep and wake).
FEATURE_RELEASE_MEMORY = "release_memory"
# Requests take preview_steps: the stream sends each row's decoded x0_hat at those steps (preview events).
FEATURE_PREVIEWS = "previews"

_ENV_PREFIX = "env/"
# An env JSON entry that stands for a tensor of the buffer: {"tensor": "<name>"}.
_TENSOR_REFERENCE = "tensor"
# Env tensors up to this size are also compared by value, to be sent once (see encode_env).
_COMPARED_BYTES = 64 * 1024

Env = dict[str, Any]  # one transformer call's keyword arguments besides hidden_states and timestep


def initial_latents_bytes(x0: torch.Tensor) -> bytes:
    """``RolloutRequest.initial_latents`` for x_0 [B, *layout.shape]: a safetensors buffer of the one
    float32 tensor ``x_0``."""
    from safetensors.torch import save

    return save({X_0: x0.detach().to(torch.float32).cpu().contiguous()})


def env_name(branch: str, prompt: int, key: str) -> str:
    return f"{_ENV_PREFIX}{branch}/{prompt}/{key}"


def split_env_name(name: str) -> tuple[str, int | None, str] | None:
    """(branch, prompt index, kwarg) of an env tensor's name, or None for a tensor that is not the
    env's. Files saved before the prompt index was part of env names give None for it (a kwarg is a
    Python identifier, with no '/': the two layouts cannot be mistaken)."""
    if not name.startswith(_ENV_PREFIX):
        return None
    parts = name[len(_ENV_PREFIX) :].split("/")
    if len(parts) == 2:
        return parts[0], None, parts[1]
    branch, prompt, key = parts
    return branch, int(prompt), key


def frame_name(frame: int) -> str:
    return f"{_FRAME_PREFIX}{frame}"


def frame_count(names) -> int:
    return sum(name.startswith(_FRAME_PREFIX) for name in names)


def stream_log_probs_name(stream: str) -> str:
    return f"{_STREAM_LOG_PROBS_PREFIX}{stream}"


def stream_log_probs_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved trajectory's per-stream log-probs by stream name."""
    prefix = _STREAM_LOG_PROBS_PREFIX
    return {name[len(prefix) :]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}


def encode_env(envs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> tuple[dict[str, torch.Tensor], str]:
    """Name the env ``envs[branch][prompt][kwarg]``: its tensors, and a JSON document of the other values.

    A tensor already named is sent once, the other entries naming it in the JSON as
    ``{"tensor": "<name>"}``: the same tensor (equal texts share their encoding, the negative prompt's
    embedding serves every prompt), or a small one of equal value (each text's own position ids).
    """
    tensors, values = {}, {}
    named: dict[tuple, str] = {}  # tensor identity -> name
    small: dict[tuple, list[tuple[torch.Tensor, str]]] = {}  # (dtype, shape) -> small tensors named
    for branch, per_prompt in envs.items():
        for p, env in per_prompt.items():
            for key, value in env.items():
                name = env_name(branch, p, key)
                if isinstance(value, torch.Tensor):
                    identity = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape)
                    earlier = named.get(identity)
                    alike = None
                    if value.nbytes <= _COMPARED_BYTES:
                        alike = small.setdefault((value.dtype, tuple(value.shape)), [])
                        if earlier is None:
                            earlier = next((n for tensor, n in alike if torch.equal(tensor, value)), None)
                    if earlier is None:
                        named[identity], tensors[name] = name, value
                        if alike is not None:
                            alike.append((value, name))
                        continue
                    value = {_TENSOR_REFERENCE: earlier}
                values.setdefault(branch, {}).setdefault(str(p), {})[key] = value
    return tensors, json.dumps(values, sort_keys=True)


def decode_env(tensors: Mapping[str, torch.Tensor], env_json: str) -> dict[str, dict[int, Env]]:
    """``env[branch][prompt][kwarg]`` from the env tensors among ``tensors`` and the JSON values
    (a referenced tensor is None in manifest-only streams, which carry no tensor bytes)."""
    envs: dict[str, dict[int, Env]] = {}
    for name, tensor in tensors.items():
        parts = split_env_name(name)
        if parts is not None:
            branch, p, key = parts
            envs.setdefault(branch, {}).setdefault(p, {})[key] = tensor
    for branch, per_prompt in json.loads(env_json or "{}").items():
        for p, values in per_prompt.items():
            for key, value in values.items():
                if isinstance(value, dict) and set(value) == {_TENSOR_REFERENCE}:
                    value = tensors.get(value[_TENSOR_REFERENCE])
                envs.setdefault(branch, {}).setdefault(int(p), {})[key] = value
    return envs
