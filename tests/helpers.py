"""What the tests share: the tiny model families, local servers, request builders, event splitting,
replay parity, weight-update helpers and grpcurl. The fixtures built from these live in conftest.py."""

import contextlib
import copy
import dataclasses
import fcntl
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import PIL.Image
import pytest
import reference
import torch
from forked import ForkedProcess
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families
from transformers.utils import is_torchvision_available

from rollout.v1 import rollout_pb2
from rollout_client import (
    Finished,
    Image,
    RolloutClient,
    Started,
    Step,
    Trajectory,
    collect,
    replay_log_probs,
)
from rollout_core import codec
from rollout_server.families import registry
from rollout_server.local import LocalServer

ROOT = Path(__file__).resolve().parents[1]
# The torch threads of every server a test starts: 1 by default (two test workers share 2 cores);
# TEST_SERVER_THREADS=2 runs the suite with servers whose kernels split their reductions otherwise.
SERVER_THREADS = os.environ.get("TEST_SERVER_THREADS", "1")
# Replay parity (docs/design.md, invariant 1): a replayed log-prob is within this of the streamed one.
TOLERANCE = 1e-5
SAMPLERS = {
    "FLOW_SDE": rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
    "DANCE": rollout_pb2.SAMPLER_TYPE_DANCE,
    "CPS": rollout_pb2.SAMPLER_TYPE_CPS,
    "ODE": rollout_pb2.SAMPLER_TYPE_ODE,
}
LATENT_DTYPES = {"float32": rollout_pb2.TENSOR_DTYPE_FLOAT32, "bfloat16": rollout_pb2.TENSOR_DTYPE_BFLOAT16}
# A client's fixed 64 KiB stream window (no BDP growth): the server can only run a few messages ahead
# of a reader that stops, then its rollout parks.
HOLDING_OPTIONS = [("grpc.http2.bdp_probe", 0)]


# Servers -------------------------------------------------------------------------------------------


def start_server(cache_dir: Path, log_path: Path, *args: str, timeout: float = 120.0) -> LocalServer:
    """A real ``rollout-server serve`` on a free loopback port, sharing the session's preset cache, in
    a process forked from the preloaded fork server (forked.py)."""
    argv = ["serve", "--port", "0", "--cache-dir", str(cache_dir), "--threads", SERVER_THREADS, *args]
    return LocalServer.once_serving(ForkedProcess(argv, log_path), log_path, timeout)


def example_module(name: str):
    """``examples/{name}.py`` as a module: its functions and its argument parser."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def at_server_threads():
    """Compute inside at the servers' torch thread count: a CPU kernel splits its reductions by the
    threads it runs on, so a reference compared bitwise with a server's output must use as many."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(SERVER_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_example(name: str, *argv) -> None:
    """Run ``examples/{name}.py ARGV`` in this process, as its command line would: a failure raises
    (SystemExit with the run's one-line reason). The torch threads and global RNG state of the test
    process are restored after: an example sets both for its run."""
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            example_module(name).main([str(arg) for arg in argv])
    finally:
        torch.set_num_threads(threads)


def command_line_exit(*argv: str) -> str:
    """Run ``rollout-server`` with ``argv`` in this process, expecting it to refuse: the message it exits
    with. Any other exception escapes, as a traceback would in a terminal."""
    from rollout_server import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    return exited.value.code


def vm_rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid``."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def imported_modules(script: str, *args: str) -> tuple[int, set[str]]:
    """Run the console script ``script`` with ``args`` under ``python -X importtime``: its exit status
    and every module it imported."""
    command = [sys.executable, "-X", "importtime", str(Path(sys.executable).with_name(script)), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    return result.returncode, {line.rsplit("|", 1)[1].strip() for line in lines[1:]}  # [0]: the header


METRICS_LINE = re.compile(r"metrics at (?P<url>http://\S+/metrics)")
HTTP_LINE = re.compile(r"SGLang-compatible HTTP API at (?P<url>https?://\S+) ")


def metrics_url(server: LocalServer) -> str:
    """The /metrics address of a server started with ``--metrics-port``, from its log."""
    return METRICS_LINE.search(server.log())["url"]


def http_url(server: LocalServer) -> str:
    """The HTTP front end's address of a server started with ``--http-port``, from its log."""
    return HTTP_LINE.search(server.log())["url"]


def scrape(url: str) -> dict[tuple, float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# SGLang's released package, whose own code the HTTP front end is checked against.
SGLANG = "sglang==0.5.23"


def sglang_source(cache_dir: Path, member: str) -> str:
    """The text of ``member`` (a path inside the package) of SGLang's released wheel, downloaded from
    the package index once per run into the shared cache (under a lock: the test workers share it).
    Its files are loaded by path or taken apart, never imported as the package: that would pull its
    GPU stack. Nothing of it is in the repo."""
    folder = cache_dir / SGLANG.replace("==", "-")
    folder.mkdir(exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not any(folder.glob("sglang-*.whl")):
            download = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "-d",
                str(folder),
                SGLANG,
            ]
            subprocess.run(download, check=True, timeout=600)
    with zipfile.ZipFile(next(folder.glob("sglang-*.whl"))) as wheel:
        return wheel.read(member).decode()


# GetServerInfo.features of every server, in the order it lists them; a server adds its own after them.
SERVED_FEATURES = [
    "lora",
    "tree",
    "prune_points",
    "weight_sync",
    "sigmas",
    "initial_latents",
    "release_memory",
]


# Model families ------------------------------------------------------------------------------------


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
    # What test_replay.py's replay-parity test covers: each sampler with CFG off and on, at each latent
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


# FluxTransformer2DModel's kwargs besides hidden_states and timestep (guidance is None without an embedding).
FLUX_ENV_KEYS = frozenset(
    {
        "encoder_hidden_states",
        "pooled_projections",
        "guidance",
        "txt_ids",
        "img_ids",
        "joint_attention_kwargs",
        "return_dict",
    }
)
# Flux2Transformer2DModel's kwargs besides hidden_states and timestep (guidance is None for [klein]).
FLUX2_ENV_KEYS = frozenset(
    {"encoder_hidden_states", "txt_ids", "img_ids", "guidance", "joint_attention_kwargs", "return_dict"}
)
SHORT_PROMPT = "a fox"
LONG_PROMPT = "A cozy cabin in the mountains covered with fresh snow, warm light in the windows."
# FLUX.1-dev: packed 2x2 tokens, embedded guidance, true CFG.
FLUX = Family(
    preset="tiny-flux",
    transformer="FluxTransformer2DModel",
    pipeline="FluxPipeline",
    prompts=("a red fox in the snow", "two cats"),
    base_seed=11,
    cfg_on={"true_cfg_scale": 3.0, "negative_prompt": "blurry, low quality"},
    cfg_off={},
    timestep_divisor=1000.0,
    cfg_rule=("true_cfg", 3.0),
    env_keys=FLUX_ENV_KEYS,
    latent_shape=(16, 16),  # 4 x 4 packed tokens of 4 x 4 channels
    replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
    replay_latent_dtypes=("float32", "bfloat16"),
)
# Qwen-Image: every prompt has its own text length, and true CFG rescales to the positive norm.
QWEN_IMAGE = Family(
    preset="tiny-qwen-image",
    transformer="QwenImageTransformer2DModel",
    pipeline="QwenImagePipeline",
    prompts=(SHORT_PROMPT, LONG_PROMPT),
    base_seed=31,
    cfg_on={"true_cfg_scale": 4.0, "negative_prompt": "blurry"},
    cfg_off={"true_cfg_scale": 1.0},
    timestep_divisor=1000.0,
    cfg_rule=("true_cfg_norm_rescale", 4.0),
    env_keys=frozenset(
        {
            "encoder_hidden_states",
            "encoder_hidden_states_mask",
            "img_shapes",
            "guidance",
            "attention_kwargs",
            "return_dict",
        }
    ),
    latent_shape=(16, 4 * 16),  # 4 x 4 packed tokens of 4 x 16 channels
)
# Wan 2.1: video latents, the raw integer timestep, classic CFG on guidance_scale.
WAN = Family(
    preset="tiny-wan",
    transformer="WanTransformer3DModel",
    pipeline="WanPipeline",
    prompts=("a red fox in the snow", "two cats"),
    base_seed=41,
    cfg_on={"guidance_scale": 5.0, "negative_prompt": "blurry"},
    cfg_off={"guidance_scale": 1.0},
    timestep_divisor=1.0,
    cfg_rule=("true_cfg", 5.0),
    env_keys=frozenset({"encoder_hidden_states", "attention_kwargs", "return_dict"}),
    latent_shape=(16, 2, 8, 8),  # the preset's 5 frames: 2 latent frames of 8 x 8
    replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
    text_width="text_dim",
)

FAMILIES = {
    "flux": FLUX,
    # FLUX.1 Kontext: FLUX's call with the conditioning image's packed latents appended to the tokens.
    "flux-kontext": dataclasses.replace(
        FLUX,
        preset="tiny-flux-kontext",
        pipeline="FluxKontextPipeline",
        prompts=("make the fox red", "two cats on the snow"),
        base_seed=61,
        env_keys=FLUX_ENV_KEYS | {"image_latents"},
        replay_samplers=("FLOW_SDE", "CPS"),
        replay_latent_dtypes=(None,),
        conditioning=("CONDITIONING_CONCAT_SEQUENCE", "image_latents"),
    ),
    # The pretrained shapes preset: FLUX's family without a guidance embedding (guidance is None in
    # its env), a 4x VAE and 24 text tokens.
    "shapes": Family(
        preset="shapes",
        transformer="FluxTransformer2DModel",
        pipeline="FluxPipeline",
        prompts=("a red circle", "a blue square to the left of a yellow triangle"),
        base_seed=51,
        cfg_on={"true_cfg_scale": 3.0, "negative_prompt": ""},  # the preset's default
        cfg_off={"true_cfg_scale": 1.0},
        timestep_divisor=1000.0,
        cfg_rule=("true_cfg", 3.0),
        env_keys=FLUX_ENV_KEYS,
        latent_shape=(64, 16),  # 8 x 8 packed tokens, each 2 x 2 latent pixels of 4 channels
    ),
    # SD3: unpacked latents, the raw timestep, CFG driven by guidance_scale.
    "sd3": Family(
        preset="tiny-sd3",
        transformer="SD3Transformer2DModel",
        pipeline="StableDiffusion3Pipeline",
        prompts=("a red fox in the snow", "two cats"),
        base_seed=21,
        cfg_on={"guidance_scale": 4.5, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1.0,
        cfg_rule=("true_cfg", 4.5),
        env_keys=frozenset(
            {"encoder_hidden_states", "pooled_projections", "joint_attention_kwargs", "return_dict"}
        ),
        latent_shape=(16, 8, 8),
    ),
    # FLUX.2 [klein]: packed 2x2 patches, 4-D position ids, a Qwen3 embedding of three stacked hidden
    # states, CFG driven by guidance_scale and no guidance embedding (guidance is None in its env).
    "flux2-klein": Family(
        preset="tiny-flux2-klein",
        transformer="Flux2Transformer2DModel",
        pipeline="Flux2KleinPipeline",
        prompts=("a red fox in the snow", "two cats"),
        base_seed=91,
        cfg_on={"guidance_scale": 4.0, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1000.0,
        cfg_rule=("true_cfg", 4.0),
        env_keys=FLUX2_ENV_KEYS,
        latent_shape=(16, 16),  # 4 x 4 packed tokens of 4 x 4 channels
        replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
        replay_latent_dtypes=("float32", "bfloat16"),
    ),
    # FLUX.2 [dev]: [klein]'s call with a Mistral3 embedding and the guidance scale embedded, no CFG.
    "flux2": Family(
        preset="tiny-flux2",
        transformer="Flux2Transformer2DModel",
        pipeline="Flux2Pipeline",
        prompts=("a red fox in the snow", "two cats"),
        base_seed=101,
        cfg_on={},
        cfg_off={"guidance_scale": 3.5},
        timestep_divisor=1000.0,
        cfg_rule=("none", 1.0),
        env_keys=FLUX2_ENV_KEYS,
        latent_shape=(16, 16),  # 4 x 4 packed tokens of 4 x 4 channels
        replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
        replay_latent_dtypes=("float32", "bfloat16"),
        replay_cfg=(False,),
    ),
    "qwen-image": QWEN_IMAGE,
    # Qwen-Image-Edit: Qwen-Image's call with the image's packed latents appended to the tokens, and
    # prompt embeddings that read the image (the Qwen2.5-VL encoder's vision tokens).
    "qwen-image-edit": dataclasses.replace(
        QWEN_IMAGE,
        preset="tiny-qwen-image-edit",
        pipeline="QwenImageEditPipeline",
        prompts=("make the fox red", LONG_PROMPT),
        base_seed=81,
        env_keys=QWEN_IMAGE.env_keys | {"image_latents"},
        conditioning=("CONDITIONING_CONCAT_SEQUENCE", "image_latents"),
        missing="" if is_torchvision_available() else "its Qwen2VLProcessor needs torchvision, not installed",
    ),
    "wan": WAN,
    # Wan 2.2: two experts; of 4 steps (timesteps 999, 900, 750, 500) the last two are below the
    # boundary (875) and run transformer_2.
    "wan2.2": dataclasses.replace(
        WAN,
        preset="tiny-wan2.2",
        base_seed=51,
        experts=("transformer", "transformer_2"),
        step_transformers=("transformer", "transformer", "transformer_2", "transformer_2"),
    ),
    # Wan 2.1 image-to-video: Wan's call with the first frame's mask and latents concatenated to the
    # channels, and cross-attention to its CLIP image embeddings too.
    "wan-i2v": dataclasses.replace(
        WAN,
        preset="tiny-wan-i2v",
        pipeline="WanImageToVideoPipeline",
        prompts=("the fox runs off", "the cats turn around"),
        base_seed=71,
        env_keys=WAN.env_keys | {"encoder_hidden_states_image", "condition"},
        replay_samplers=("FLOW_SDE", "CPS"),
        conditioning=("CONDITIONING_CONCAT_CHANNELS", "condition"),
    ),
    # HunyuanVideo 1.5: video latents with C + 1 conditioning channels of zeros, the raw timestep, two
    # text encoders (Qwen2.5-VL and ByT5, each with its mask), zero image embeddings, classic CFG on
    # guidance_scale.
    "hunyuan-video15": Family(
        preset="tiny-hunyuan-video15",
        transformer="HunyuanVideo15Transformer3DModel",
        pipeline="HunyuanVideo15Pipeline",
        prompts=("a red fox in the snow", 'a sign that says "open"'),  # the second quotes glyph text
        base_seed=111,
        cfg_on={"guidance_scale": 6.0, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1.0,
        cfg_rule=("true_cfg", 6.0),
        env_keys=frozenset(
            {
                "encoder_hidden_states",
                "encoder_attention_mask",
                "encoder_hidden_states_2",
                "encoder_attention_mask_2",
                "image_embeds",
                "condition",
                "attention_kwargs",
                "return_dict",
            }
        ),
        latent_shape=(32, 2, 4, 4),  # the preset's 5 frames: 2 latent frames of 4 x 4 (16x VAE)
        text_width="text_embed_dim",
        conditioning=("CONDITIONING_CONCAT_CHANNELS", "condition"),
    ),
    # LTX-2: two latent streams per sample (packed video tokens, then packed audio tokens) in one joint
    # latent, the connectors' video and audio text states with one mask, the raw float32 timestep also
    # fed as sigma, classic CFG on guidance_scale for both streams.
    "ltx2": Family(
        preset="tiny-ltx2",
        transformer="LTX2VideoTransformer3DModel",
        pipeline="LTX2Pipeline",
        prompts=("a drum and a bell", "rain on a tin roof at night"),
        base_seed=131,
        cfg_on={"guidance_scale": 3.0, "negative_prompt": "silence"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1.0,
        cfg_rule=("true_cfg", 3.0),
        env_keys=frozenset(
            {
                "encoder_hidden_states",
                "audio_encoder_hidden_states",
                "encoder_attention_mask",
                "audio_encoder_attention_mask",
                "video_coords",
                "audio_coords",
                "num_frames",
                "height",
                "width",
                "fps",
                "audio_num_frames",
                "isolate_modalities",
                "spatio_temporal_guidance_blocks",
                "perturbation_mask",
                "use_cross_timestep",
                "attention_kwargs",
                "return_dict",
            }
        ),
        # The preset's 9 frames: video 2 x 2 x 2 tokens of 128 channels, then audio 9 tokens of 8 x 4.
        latent_shape=(8 * 128 + 9 * 32,),
        text_width="caption_channels",
    ),
    # Cosmos3: one sample per call, its text as token ids packed before its video latent patches, the
    # raw timestep in float32 once per noisy vision token, classic CFG on guidance_scale with the
    # negative prompt's own (inverse) templates.
    "cosmos3": Family(
        preset="tiny-cosmos3",
        transformer="Cosmos3OmniTransformer",
        pipeline="Cosmos3OmniPipeline",
        prompts=(SHORT_PROMPT, LONG_PROMPT),  # two text lengths: two packed sequences of their own
        base_seed=121,
        cfg_on={"guidance_scale": 6.0, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1.0,
        cfg_rule=("true_cfg", 6.0),
        env_keys=frozenset(
            {
                "input_ids",
                "text_indexes",
                "position_ids",
                "und_len",
                "sequence_length",
                "vision_token_shapes",
                "vision_sequence_indexes",
                "vision_mse_loss_indexes",
                "vision_noisy_frame_indexes",
                "return_dict",
            }
        ),
        latent_shape=(48, 2, 4, 4),  # the preset's 5 frames: 2 latent frames of 4 x 4 (16x VAE)
        text_key="",  # token ids, no text states
    ),
    # Z-Image: per-sample latents with a frame axis under x, (1000 - t) / 1000 in float32 under t, the
    # negated prediction, prompts of their own lengths, and CFG around the positive branch, on with
    # guidance_scale > 0.
    "z-image": Family(
        preset="tiny-z-image",
        transformer="ZImageTransformer2DModel",
        pipeline="ZImagePipeline",
        prompts=(SHORT_PROMPT, LONG_PROMPT),
        base_seed=91,
        cfg_on={"guidance_scale": 4.0, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 0.0},
        timestep_divisor=1000.0,
        cfg_rule=("cfg_from_positive", 4.0),
        cfg_off_rule=("none", 0.0),
        env_keys=frozenset({"cap_feats", "return_dict"}),
        latent_shape=(16, 8, 8),
        replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
        replay_latent_dtypes=("float32", "bfloat16"),
        text_key="cap_feats",
        text_width="cap_feat_dim",
    ),
}


def condition_png(index: int, width: int = 64, height: int = 64) -> bytes:
    """A conditioning image, different for each ``index``: a colour gradient with a square on it."""
    rng = np.random.default_rng(index)
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, np.full_like(xs, 40 * index % 256)], axis=-1)
    top, left = rng.integers(0, height // 2), rng.integers(0, width // 2)
    pixels[top : top + height // 3, left : left + width // 3] = rng.integers(0, 256, 3)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def condition_image(index: int) -> PIL.Image.Image:
    """The image ``family_request`` sends for prompt ``index``, as the server reads it (64 x 64 RGB)."""
    return PIL.Image.open(io.BytesIO(condition_png(index))).convert("RGB")


def adapter_ode(
    adapter, x0, texts: dict[str, list[str]], images, guidance_scale: float, rule, shape, steps=4
):
    """An image-conditioned family's ODE by hand: Euler over the adapter's schedule from ``x0``, each
    velocity by the transformer-call rule with the expert of its step and each branch's env (the
    branch's ``texts``, one per image, each merged with its image's entries and batched as the server
    batches rows), the branches combined by the guidance ``rule``."""
    from rollout_core.transformer_call import apply_guidance, call_transformer, stack_envs

    def env(text, image):
        read = image if adapter.text_reads_image else None
        return {
            **adapter.encode_text(text, guidance_scale, shape, read),
            **adapter.encode_image(image, shape),
        }

    envs = {
        branch: stack_envs(
            [env(t, i) for t, i in zip(per_image, images, strict=True)], adapter.batched_env_keys
        )
        for branch, per_image in texts.items()
    }
    sigmas, timesteps = adapter.schedule(steps, shape)
    x = x0
    for i in range(steps):
        expert = adapter.experts[adapter.expert_for(float(timesteps[i]))]
        velocities = {
            branch: call_transformer(
                expert, x, timesteps[i], env, torch.float32, adapter.timestep_divisor, adapter.conditioning
            )
            for branch, env in envs.items()
        }
        x = x + (sigmas[i + 1] - sigmas[i]) * apply_guidance(*rule, velocities)
    return x


def env_at(adapter, prompt: str, shape) -> dict[str, Any]:
    """The env of ``prompt`` at ``shape``, with an image-conditioned family's entries of
    ``condition_image(0)`` at that size (its text encoding reading the image where the family's does)."""
    image = condition_image(0).resize((shape.width, shape.height)) if adapter.takes_images else None
    env = adapter.encode_text(prompt, 1.0, shape, image if adapter.text_reads_image else None)
    return env if image is None else {**env, **adapter.encode_image(image, shape)}


def forward_at(adapter, prompt: str, shape) -> torch.Tensor:
    """One forward of the adapter's transformer on zero latents at ``shape`` with ``prompt``'s env, by
    the adapter's whole transformer-call rule (its conditioning, its call form at the shape, its
    batched entries): the velocity."""
    return forward_of(adapter, env_at(adapter, prompt, shape), shape)


def forward_of(adapter, env: dict[str, Any], shape) -> torch.Tensor:
    """``forward_at`` with the env given (the call takes its conditioning entry out of it)."""
    from rollout_core.transformer_call import call_transformer

    x = torch.zeros(1, *adapter.latent_shape(shape))
    with torch.no_grad():
        return call_transformer(
            adapter.transformer,
            x,
            500.0,
            env,
            torch.float32,
            adapter.timestep_divisor,
            adapter.conditioning,
            form=adapter.call_form_for(shape),
            batched_env_keys=adapter.batched_env_keys,
        )


def joint_attention_tokens(adapter, env: dict, shape) -> int:
    """The tokens the first transformer block's joint attention runs over (generated, conditioning and
    text) in one forward of ``env`` by the transformer-call rule, which must give x's shape back."""
    from rollout_core.transformer_call import call_transformer

    seen = []

    def record(module, args, kwargs):
        seen.append(kwargs["hidden_states"].shape[1] + kwargs["encoder_hidden_states"].shape[1])

    handle = adapter.transformer.transformer_blocks[0].register_forward_pre_hook(record, with_kwargs=True)
    try:
        x = torch.zeros(1, *adapter.latent_shape(shape))
        v = call_transformer(adapter.transformer, x, 1000.0, env, torch.float32, 1000.0, adapter.conditioning)
    finally:
        handle.remove()
    assert v.shape == x.shape
    return seen[0]


def family_request(family: str, sampler: str, cfg: bool, **fields) -> rollout_pb2.RolloutRequest:
    """Two prompts, two samples each, 4 steps at 64 x 64 without images, CFG on or off as the family
    does it, and a conditioning image per prompt for an image-conditioned family; ``fields`` override
    (None leaves a field unset)."""
    spec = FAMILIES[family]
    if registry.adapter_class(spec.pipeline).takes_images:
        images = [rollout_pb2.ConditionImage(data=condition_png(p)) for p in range(len(spec.prompts))]
        fields = {"condition_images": images, **fields}
    base = {
        "prompts": list(spec.prompts),
        "samples_per_prompt": 2,
        "base_seed": spec.base_seed,
        "height": 64,
        "width": 64,
        "num_steps": 4,
        "sampler": SAMPLERS[sampler],
        "images": False,
    }
    return make_request(base, spec.cfg_on if cfg else spec.cfg_off, fields)


def qwen_text_length(pipe, prompt: str) -> int:
    """The prompt's token count after QwenImagePipeline drops its template's system prefix."""
    tokens = pipe.tokenizer(pipe.prompt_template_encode.format(prompt)).input_ids
    return len(tokens) - pipe.prompt_template_encode_start_idx


# Requests and events -------------------------------------------------------------------------------


def make_request(*fields: dict, **more) -> rollout_pb2.RolloutRequest:
    """A RolloutRequest from dicts of fields merged left to right, then ``more``; None leaves a field
    unset."""
    merged = {}
    for part in (*fields, more):
        merged.update(part)
    return rollout_pb2.RolloutRequest(**{name: value for name, value in merged.items() if value is not None})


@dataclass
class Rollout:
    """A decoded rollout stream, split by event type."""

    events: list
    started: Started
    steps: list[Step]
    images: list[Image]
    finished: Finished

    def trajectories(self) -> list[Trajectory]:
        return collect(self.events)


def split_events(events: Iterable) -> Rollout:
    """Split a stream into its started event, steps, images and finished event, checking its shape."""
    events = list(events)
    kinds = [type(event).__name__ for event in events]
    started, *middle, finished = events
    assert isinstance(started, Started) and isinstance(finished, Finished), kinds
    steps = [event for event in middle if isinstance(event, Step)]
    images = [event for event in middle if isinstance(event, Image)]
    assert [type(event) for event in middle] == [Step] * len(steps) + [Image] * len(images), kinds
    return Rollout(events, started, steps, images, finished)


def stream_at_sp2(cache_dir: Path, log_path: Path, preset: str, request) -> Rollout:
    """The events of ``request`` from a fresh server of ``preset`` at --sp 2, stopped cleanly after."""
    server = start_server(cache_dir, log_path, "--model", preset, "--sp", "2")
    try:
        with RolloutClient(server.address, timeout=300) as client:
            run = split_events(client.stream(request))
    finally:
        assert server.stop() == 0
    assert run.started.message.sp_degree == 2
    return run


def stream_events(client: RolloutClient, *fields: dict, **more) -> Rollout:
    """Stream the request ``make_request(*fields, **more)`` and split its events."""
    return split_events(client.stream(make_request(*fields, **more)))


def assert_same_kwargs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same transformer kwargs: tensors bitwise equal, other values equal."""
    assert a.keys() == b.keys()
    for key, value in a.items():
        same = torch.equal(value, b[key]) if isinstance(value, torch.Tensor) else value == b[key]
        assert same, key


def assert_same_env(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> None:
    """Two started events' envs are the same, branch by branch and prompt by prompt."""
    assert a.keys() == b.keys()
    for branch in a:
        for kwargs_a, kwargs_b in zip(a[branch], b[branch], strict=True):
            assert_same_kwargs(kwargs_a, kwargs_b)


def assert_same_numbers(
    a: Rollout, b: Rollout, bitwise_log_probs: bool, tolerance: float = TOLERANCE
) -> None:
    """Two runs of one request (another SP degree, alone or batched with other rollouts): x_0 and every
    eps bitwise, latents and (when streamed) velocities within ``tolerance``, log-probs bitwise or
    within TOLERANCE."""
    assert torch.equal(a.started.x0, b.started.x0)
    assert [step.index for step in a.steps] == [step.index for step in b.steps]
    for one, two in zip(a.steps, b.steps, strict=True):
        assert one.stochastic == two.stochastic
        torch.testing.assert_close(one.x_next, two.x_next, atol=tolerance, rtol=0)
        if "velocity" in one.debug:
            torch.testing.assert_close(one.debug["velocity"], two.debug["velocity"], atol=tolerance, rtol=0)
        if one.stochastic:
            assert torch.equal(one.debug["eps"], two.debug["eps"])
            if bitwise_log_probs:
                assert torch.equal(one.log_probs, two.log_probs), one.index
            else:
                torch.testing.assert_close(one.log_probs, two.log_probs, atol=TOLERANCE, rtol=0)


# Replay parity -------------------------------------------------------------------------------------


def stochastic_steps(trajectory: Trajectory) -> list[int]:
    return torch.nonzero(trajectory.stochastic).flatten().tolist()


def assert_replays(
    transformer: torch.nn.Module, trajectories: Iterable[Trajectory], bare_reference: bool = False
) -> None:
    """Every stochastic step of each trajectory, replayed through ``transformer`` by the client
    library (and with ``bare_reference`` also by a bare diffusers call and the float64 formulas of
    reference.py), scores within TOLERANCE of the streamed log-prob; the other steps stay NaN."""
    for trajectory in trajectories:
        streamed = trajectory.log_probs
        replayed = replay_log_probs(transformer, trajectory)
        np.testing.assert_allclose(replayed.numpy(), streamed.numpy(), atol=TOLERANCE, rtol=0, equal_nan=True)
        if bare_reference:
            bare = reference.bare_log_probs(transformer, trajectory)
            assert bare.keys() == set(stochastic_steps(trajectory))
            for i, value in bare.items():
                assert abs(value - streamed[i].item()) <= TOLERANCE, (i, value, streamed[i].item())


# Weight updates ------------------------------------------------------------------------------------

TO_Q = "transformer_blocks.0.attn.to_q.weight"
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# A small rollout whose final latents show the policy a server runs.
FINGERPRINT_REQUEST = {
    "prompts": ["a lighthouse"],
    "samples_per_prompt": 1,
    "base_seed": 5,
    "height": 64,
    "width": 64,
    "num_steps": 2,
    "debug_tensors": [rollout_pb2.DEBUG_TENSOR_EPS],
    "images": False,
}


def next_version(client: RolloutClient) -> int:
    return client.server_info().policy_version + 1


def fingerprint(client: RolloutClient) -> tuple:
    """The policy version, the LoRA adapter and the final latents of a small rollout."""
    info = client.server_info()
    rollout = stream_events(client, FINGERPRINT_REQUEST)
    return info.policy_version, info.lora_adapter.SerializeToString(), rollout.steps[-1].x_next


def assert_unchanged(before: tuple, client: RolloutClient) -> None:
    """Same version, same adapter, bitwise the same final latents as ``before`` (a fingerprint)."""
    after = fingerprint(client)
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])


def push_update(
    client: RolloutClient, header: rollout_pb2.WeightsUpdateHeader, data: bytes, timeout: float
) -> None:
    """A raw UpdateWeights stream: ``data`` in 4 KiB messages after ``header``."""
    messages = [rollout_pb2.UpdateWeightsRequest(header=header)]
    messages += [rollout_pb2.UpdateWeightsRequest(data=piece) for piece in codec.pieces(data, 4096)]
    client.stub.UpdateWeights(iter(messages), timeout=timeout)


def perturbed(transformer: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The trainer's copy after an optimiser step (a seeded perturbation of every weight)."""
    trained = copy.deepcopy(transformer)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return trained


def with_lora(transformer: torch.nn.Module, trained: bool, targets: list[str] = LORA_TARGETS):
    """The trainer's copy with a PEFT LoRA adapter on ``targets``, freshly initialised (lora_B = 0) or
    trained, and its LoraConfig."""
    from peft import LoraConfig

    adapted = copy.deepcopy(transformer)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    adapted.add_adapter(config)
    if trained:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, parameter in adapted.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return adapted, config


# gRPC errors and grpcurl ---------------------------------------------------------------------------

SERVICE = "rollout.v1.RolloutService"
GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).with_name("grpcurl"))


def health_status(channel: grpc.Channel) -> int | grpc.StatusCode:
    """The overall health status, or the error code when the check itself fails."""
    try:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as error:
        return error.code()
    return response.status


def field_violations(error: grpc.RpcError) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """The google.rpc.BadRequest field violations in an error's rich status details."""
    status = rpc_status.from_call(error)
    violations = []
    for detail in status.details if status else ():
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            violations.extend(bad_request.field_violations)
    return violations


def refused_rollout(
    client, request: rollout_pb2.RolloutRequest
) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """The field violations of a rollout the server refuses with INVALID_ARGUMENT."""
    with pytest.raises(grpc.RpcError) as refused:
        client.rollout(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return field_violations(refused.value)


def grpcurl(
    address: str, *args: str, flags: Iterable[str] = ("-plaintext",), data: dict | None = None
) -> subprocess.CompletedProcess:
    """Run grpcurl (plaintext unless ``flags`` say otherwise) and capture its output."""
    data_flags = ["-d", json.dumps(data)] if data is not None else []
    return subprocess.run(
        [GRPCURL, *flags, *data_flags, address, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def grpcurl_exit(code: grpc.StatusCode) -> int:
    """grpcurl exits with 64 + the gRPC status code on an RPC error."""
    return 64 + code.value[0]
