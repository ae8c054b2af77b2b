"""One builder a family, for a preset and for a real-size check alike.

A family's ``preset.py`` builds its pipeline from its published configs (``published.py``) merged with a
size's overrides (``TINY``, ``SMALL``, ...: the fields that scale the checkpoint down, declared beside the
published configs). A preset is that builder on the CPU with a size's overrides, seeded weights in float32,
saved (``rollout_server/presets.py``); a real-size check is the same builder on the meta device with no
overrides, in the served dtype, nothing saved. A builder returns the pipeline, unsaved. Tokenizers are
trained locally and written into the folder either way (no hub is reached).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class _TokenizerLength:
    """A size's ``vocab_size`` that is the length of the tokenizer the preset trains."""

    def __repr__(self) -> str:
        return "TOKENIZER_LENGTH"


TOKENIZER_LENGTH = _TokenizerLength()


def merged(published: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``published`` with ``overrides``, nested configs (a ``text_config``) merged key by key."""
    config = dict(published)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(config.get(key), Mapping):
            value = merged(config[key], value)
        config[key] = value
    return config


def _with_tokenizer_length(config: dict[str, Any], length: int | None) -> dict[str, Any]:
    resolved = {}
    for key, value in config.items():
        if isinstance(value, dict):
            value = _with_tokenizer_length(value, length)
        elif value is TOKENIZER_LENGTH:
            if length is None:
                raise ValueError(f"{key} is the tokenizer's length, but no tokenizer was given")
            value = length
        resolved[key] = value
    return resolved


@dataclass(frozen=True)
class Build:
    """Where and at what size a family's builder makes its pipeline.

    ``size`` maps a component's name (a pipeline component, or a part such as ``"vision"``) to the
    overrides of its published config; an empty ``size`` is the published checkpoint. ``meta`` builds on
    the meta device in bfloat16.
    """

    folder: Path
    size: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    meta: bool = False

    def config(self, component: str, published: Mapping[str, Any], tokenizer=None) -> dict[str, Any]:
        """``component``'s published config with this size's overrides; a ``TOKENIZER_LENGTH`` value
        becomes ``len(tokenizer)``."""
        config = merged(published, self.size.get(component, {}))
        return _with_tokenizer_length(config, None if tokenizer is None else len(tokenizer))

    def model(self, seed: int, model_class, *args, **kwargs) -> "torch.nn.Module":
        """``model_class(*args, **kwargs)``: seeded with ``seed`` on the CPU (a fixed seed per component
        keeps each one stable when another component's config changes), or on the meta device."""
        import torch  # here, so that published configs (which import this module) stay plain data

        if self.meta:
            with torch.device("meta"):
                return model_class(*args, **kwargs).to(torch.bfloat16)
        torch.manual_seed(seed)
        return model_class(*args, **kwargs)
