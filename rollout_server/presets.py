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

from rollout_server.families import registry

if TYPE_CHECKING:
    from rollout_server.families.base import FamilyDefaults

logger = logging.getLogger(__name__)

# The shared builder helpers every family's preset module may use.
_COMMON_SOURCES = ("components.py", "tokenizers.py", "published.py")
_FAMILIES_DIR = Path(registry.__file__).parent
_FINGERPRINTED_PACKAGES = ("diffusers", "transformers", "tokenizers", "sentencepiece", "torch")


def preset_names() -> tuple[str, ...]:
    """Every preset of every registered family, in the registry's order (no model library is loaded)."""
    return tuple(registry.presets())


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
    for path in _builder_files():
        digest.update(str(path.relative_to(_FAMILIES_DIR)).encode() + b"\0" + path.read_bytes())
    for package in _FINGERPRINTED_PACKAGES:
        digest.update(f"{package}=={version(package)}\n".encode())
    return digest.hexdigest()[:12]


def _builder_files() -> list[Path]:
    """What a build reads, found through the registry: the shared helpers, and each family's published
    configs, preset builder modules and builder data."""
    files = [_FAMILIES_DIR / "common" / name for name in _COMMON_SOURCES]
    for family in registry.specs():
        folder = _FAMILIES_DIR / family.name
        modules = {"published", *(preset.builder.split(":")[0] for preset in family.presets.values())}
        files += [folder / f"{module}.py" for module in sorted(modules)]
        for data in family.preset_data:
            files += sorted((folder / data).iterdir())
    return files


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Returns the absolute path of a folder holding a diffusers pipeline (with `model_index.json`) for
    a preset name or a path: absolute, so that a trainer in another working directory can load it.

    Presets are built into `cache_dir` (default: `default_cache_dir()`) on first use.
    """
    if name_or_path in registry.presets():
        cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        return _build_preset_once(name_or_path, cache.resolve())
    path = Path(name_or_path).expanduser().resolve()
    if (path / "model_index.json").is_file():
        return path
    if path.is_dir():
        raise FileNotFoundError(f"{path} is not a diffusers pipeline folder: it has no model_index.json")
    known = ", ".join(preset_names())
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a known preset ({known}) nor an existing model folder"
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
        family, preset = registry.presets()[name]
        module, builder = preset.builder.split(":")
        getattr(importlib.import_module(f"{family.package}.{module}"), builder)(staging, size=preset.size)
        staging.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def defaults_for(name_or_path: str, family_defaults: "FamilyDefaults") -> "FamilyDefaults":
    """The family's usual defaults, with a preset's own overrides."""
    named = registry.presets().get(name_or_path)
    return dataclasses.replace(family_defaults, **(named[1].defaults if named else {}))
