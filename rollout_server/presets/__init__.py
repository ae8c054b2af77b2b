"""Named model presets: seeded diffusers pipelines built locally on first use, never downloaded.

A preset is built once into `<cache>/models/<name>-<fingerprint>`. The fingerprint covers the builder source
and the library versions that shape the saved files, so editing a builder or upgrading diffusers/transformers
yields a fresh folder instead of silently reusing a stale one.
"""

import dataclasses
import fcntl
import functools
import hashlib
import importlib
import logging
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_server.families.base import FamilyDefaults

logger = logging.getLogger(__name__)

# name -> (builder module in this package, its build function, size). Builders are imported only to
# build, so listing the presets (e.g. in --help) loads no model library.
PRESETS: dict[str, tuple[str, str, str]] = {
    "tiny-flux": ("flux", "build_flux_preset", "tiny"),
    "small-flux": ("flux", "build_flux_preset", "small"),
    "tiny-flux-kontext": ("flux", "build_flux_kontext_preset", "tiny"),
    "tiny-flux2": ("flux2", "build_flux2_preset", "tiny"),
    "tiny-flux2-klein": ("flux2", "build_flux2_klein_preset", "tiny"),
    "tiny-sd3": ("sd3", "build_sd3_preset", "tiny"),
    "tiny-qwen-image": ("qwen_image", "build_qwen_image_preset", "tiny"),
    "tiny-qwen-image-edit": ("qwen_image", "build_qwen_image_edit_preset", "tiny"),
    "tiny-wan": ("wan", "build_wan_preset", "tiny"),
    "tiny-wan2.2": ("wan", "build_wan_preset", "tiny-2.2"),
    "tiny-wan-i2v": ("wan_i2v", "build_wan_i2v_preset", "tiny"),
    "tiny-hunyuan-video15": ("hunyuan_video15", "build_hunyuan_video15_preset", "tiny"),
    "tiny-ltx2": ("ltx2", "build_ltx2_preset", "tiny"),
    "tiny-cosmos3": ("cosmos3", "build_cosmos3_preset", "tiny"),
    "tiny-z-image": ("z_image", "build_z_image_preset", "tiny"),
    "shapes": ("shapes", "build_shapes_preset", "pretrained"),
}

_BUILDER_SOURCES = (
    "flux.py",
    "flux2.py",
    "sd3.py",
    "qwen_image.py",
    "wan.py",
    "wan_i2v.py",
    "hunyuan_video15.py",
    "ltx2.py",
    "cosmos3.py",
    "z_image.py",
    "shapes.py",
    "tokenizers.py",
    "components.py",
)
# Pretrained weights a builder loads: part of the fingerprint like the sources.
_BUILDER_DATA = ("shapes_weights",)
_FINGERPRINTED_PACKAGES = ("diffusers", "transformers", "tokenizers", "sentencepiece", "torch")


def default_cache_dir() -> Path:
    """`$ROLLOUT_SERVER_CACHE` if set, else `~/.cache/rollout-server`."""
    if env := os.environ.get("ROLLOUT_SERVER_CACHE"):
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rollout-server"


@functools.cache
def preset_fingerprint() -> str:
    """Short hash of the preset builders' source, the weights they load and the versions of the libraries
    they call."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _BUILDER_SOURCES:
        digest.update((here / name).read_bytes())
    for folder in _BUILDER_DATA:
        for path in sorted((here / folder).iterdir()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for package in _FINGERPRINTED_PACKAGES:
        digest.update(f"{package}=={version(package)}\n".encode())
    return digest.hexdigest()[:12]


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Returns the absolute path of a folder holding a diffusers pipeline (with `model_index.json`) for
    a preset name or a path: absolute, so that a trainer in another working directory can load it.

    Presets are built into `cache_dir` (default: `default_cache_dir()`) on first use.
    """
    if name_or_path in PRESETS:
        cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        return _build_preset_once(name_or_path, cache.resolve())
    path = Path(name_or_path).expanduser().resolve()
    if (path / "model_index.json").is_file():
        return path
    if path.is_dir():
        raise FileNotFoundError(f"{path} is not a diffusers pipeline folder: it has no model_index.json")
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a known preset ({', '.join(PRESETS)}) nor an existing model folder"
    )


def _build_preset_once(name: str, cache_dir: Path) -> Path:
    """Builds into a temporary sibling and renames it into place, so readers never see a partial preset.

    Processes that start together on one cache (replicas of a node, test workers) take turns on a lock
    file: the first builds, the others find its preset. Where the lock is not shared (a network file
    system without locks), both build, one rename wins and the loser discards its copy.
    """
    models_dir = cache_dir / "models"
    target = models_dir / f"{name}-{preset_fingerprint()}"
    if (target / "model_index.json").is_file():
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    locks = cache_dir / "locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model_index.json").is_file():
            return target
        return _build(name, target)


def _build(name: str, target: Path) -> Path:
    models_dir = target.parent
    logger.info("Building model preset %r into %s", name, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=models_dir))
    try:
        module, builder, size = PRESETS[name]
        getattr(importlib.import_module(f".{module}", __package__), builder)(staging, size=size)
        staging.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# Tiny presets run on a laptop CPU: small images and few steps unless the request says otherwise.
PRESET_DEFAULTS: dict[str, dict[str, int | float]] = {
    "tiny-flux": {"height": 128, "width": 128, "num_steps": 10},
    "small-flux": {"height": 256, "width": 256, "num_steps": 10},
    "tiny-flux-kontext": {"height": 128, "width": 128, "num_steps": 10},
    "tiny-flux2": {"height": 128, "width": 128, "num_steps": 10},
    "tiny-flux2-klein": {"height": 128, "width": 128, "num_steps": 10},
    "tiny-sd3": {"height": 128, "width": 128, "num_steps": 10},
    "tiny-qwen-image": {"height": 128, "width": 128, "num_steps": 10},
    "tiny-qwen-image-edit": {"height": 128, "width": 128, "num_steps": 10},
    "tiny-wan": {"height": 64, "width": 64, "frames": 5, "num_steps": 10},
    "tiny-wan2.2": {"height": 64, "width": 64, "frames": 5, "num_steps": 10},
    "tiny-wan-i2v": {"height": 64, "width": 64, "frames": 5, "num_steps": 10},
    "tiny-hunyuan-video15": {"height": 64, "width": 64, "frames": 5, "num_steps": 10},
    # 64: the VAE's decoder needs 2x2 latents (32x); 9 = 1 + 8 frames, two latent frames (8x, causal).
    "tiny-ltx2": {"height": 64, "width": 64, "frames": 9, "num_steps": 10},
    "tiny-cosmos3": {"height": 64, "width": 64, "frames": 5, "num_steps": 10},
    "tiny-z-image": {"height": 128, "width": 128, "num_steps": 10},
    # The size it was pretrained at, and true CFG against the empty caption it was also trained on.
    "shapes": {"height": 64, "width": 64, "num_steps": 20, "true_cfg_scale": 3.0},
}


def defaults_for(name_or_path: str, family_defaults: "FamilyDefaults") -> "FamilyDefaults":
    """The family's usual defaults, with a preset's own overrides."""
    return dataclasses.replace(family_defaults, **PRESET_DEFAULTS.get(name_or_path, {}))
