"""The one list of model families: names -> packages, nothing imported until asked.

Everything that needs to know the families reads this module: ``model_index.json`` dispatch
(``families.detect``), the preset names of the CLI, the preset builders and their fingerprint, and the
tests. Asking for a spec imports the family's ``__init__.py`` only (plain data); asking for an adapter
class imports its ``adapter`` module, and with it torch and diffusers.

Adding a family is adding its folder and one line here.
"""

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_server.families.base import FamilyAdapter
    from rollout_server.families.spec import FamilySpec, Preset

FAMILIES: tuple[str, ...] = (
    "flux",
    "flux2",
    "sd3",
    "qwen_image",
    "wan",
    "wan_i2v",
    "hunyuan_video15",
    "ltx2",
    "cosmos3",
    "z_image",
)


@functools.cache
def spec(name: str) -> "FamilySpec":
    """The spec a family's package declares as ``SPEC``."""
    if name not in FAMILIES:
        raise KeyError(f"no model family {name!r} (families: {', '.join(FAMILIES)})")
    declared = importlib.import_module(f"rollout_server.families.{name}").SPEC
    assert declared.name == name, f"{name}'s package declares {declared.name!r}"
    return declared


def specs() -> tuple["FamilySpec", ...]:
    return tuple(spec(name) for name in FAMILIES)


@functools.cache
def _pipelines() -> dict[str, "FamilySpec"]:
    served: dict[str, FamilySpec] = {}
    for family in specs():
        for pipeline_class in family.adapters:
            assert pipeline_class not in served, f"{pipeline_class} is served by two families"
            served[pipeline_class] = family
    return served


def pipeline_classes() -> tuple[str, ...]:
    """Every pipeline class name a family serves."""
    return tuple(_pipelines())


def family_of(pipeline_class: str) -> "FamilySpec":
    """The spec of the family serving ``pipeline_class`` (a ``KeyError`` if none does)."""
    return _pipelines()[pipeline_class]


def adapter_class(pipeline_class: str) -> type["FamilyAdapter"]:
    """The adapter class for ``pipeline_class``, imported now (a ``KeyError`` if no family serves it)."""
    family = family_of(pipeline_class)
    module = importlib.import_module(f"{family.package}.adapter")
    return getattr(module, family.adapters[pipeline_class])


@functools.cache
def presets() -> dict[str, tuple["FamilySpec", "Preset"]]:
    """Preset name -> (its family's spec, the preset), in the registry's order."""
    named: dict[str, tuple[FamilySpec, Preset]] = {}
    for family in specs():
        for name, preset in family.presets.items():
            assert name not in named, f"preset {name!r} is declared by two families"
            named[name] = (family, preset)
    return named
