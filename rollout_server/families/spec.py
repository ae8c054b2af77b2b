"""What a family declares about itself as plain data, importable without torch or diffusers.

A family's ``__init__.py`` holds one ``FamilySpec``. The spec says what the registry, the CLI, the preset
cache and the tests need before any model library loads: the pipeline classes it serves (by name) and
where their adapters live, its presets and its default LoRA targets. Everything about how a model is
called (call form, CFG rule, solver, latent streams, features) is declared by the adapter class itself
(``families/base.py``): the adapter is the truth for those, and the spec does not repeat them.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Preset:
    """A seeded pipeline the server builds locally under the preset's name.

    ``builder`` is ``"module:function"`` in the family's package; the function is called as
    ``function(folder, size=size)`` and saves a diffusers pipeline into ``folder``. ``defaults`` override
    the adapter's request defaults (``FamilyDefaults`` fields) for this preset.
    """

    builder: str
    size: str
    defaults: Mapping[str, int | float] = field(default_factory=dict)


@dataclass(frozen=True)
class FamilySpec:
    """One family: its folder ``rollout_server/families/<name>/`` and what it serves.

    - ``adapters``: pipeline class name (``model_index.json``'s ``_class_name``) -> the adapter class's
      name in the family's ``adapter`` module, imported only when a folder of that class is loaded;
    - ``lora_targets``: the trainer's default LoRA target modules for every adapter of the family, module
      names as PEFT matches them (a name, or the end of a dotted one);
    - ``presets``: preset name -> ``Preset``;
    - ``preset_data``: folders of the package a builder reads (pretrained weights), part of the preset
      fingerprint like the builder sources.
    """

    name: str
    adapters: Mapping[str, str]
    lora_targets: tuple[str, ...]
    presets: Mapping[str, Preset]
    preset_data: tuple[str, ...] = ()

    def __post_init__(self):
        # Read-only views: a spec is shared by every caller of the registry.
        object.__setattr__(self, "adapters", MappingProxyType(dict(self.adapters)))
        object.__setattr__(self, "presets", MappingProxyType(dict(self.presets)))

    @property
    def package(self) -> str:
        """The family's package, ``rollout_server.families.<name>``."""
        return f"rollout_server.families.{self.name}"
