"""The LoraConfig of a LORA update, read from the client's JSON against an explicit allow-list.

PEFT matches a string ``target_modules`` (and ``exclude_modules``, ``layers_pattern``, the keys of
``rank_pattern`` / ``alpha_pattern``) as a regular expression, with the GIL held: a client's pattern
could freeze the server. So no client string reaches PEFT as a pattern. A config may set only the
fields below, each checked; every other LoraConfig field must keep PEFT's default (so a trainer's
``LoraConfig(...).to_dict()`` passes), and the LoraConfig is built from the checked values alone.
"""

import json
import math
import re
from collections.abc import Callable
from typing import Any

from peft import LoraConfig

from rollout_server.errors import InvalidRequest
from rollout_server.quoting import quoted

FIELD = "header.lora_config_json"
MAX_CONFIG_CHARS = 64 * 1024
MAX_TARGET_MODULES = 256
MAX_MODULE_NAME_CHARS = 128
MAX_RANK = 4096
# A module name or a dotted path of them: PEFT matches list entries by name, not as patterns.
MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
# LoRA inits that only set the adapter's own weights. The others (PiSSA, OLoRA, CorDA, LoftQ, ...) also
# rewrite the base weights when the adapter is created, which would silently change the policy here.
SAFE_LORA_INITS = (True, False, "gaussian", "orthogonal")
# Fields that describe where a config came from, not what the adapter computes: dropped.
METADATA_FIELDS = {
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "task_type",
    "auto_mapping",
    "peft_version",
}


def _peft_defaults() -> dict[str, Any]:
    values = LoraConfig().to_dict()
    return json.loads(json.dumps(values, default=lambda value: sorted(value)))


PEFT_DEFAULTS = _peft_defaults()
UNSET = (None, False, [], {})


def _reject(key: str, description: str) -> InvalidRequest:
    return InvalidRequest([(FIELD, f"{quoted(key)}: {description}")])


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _target_modules(value: Any) -> list[str]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_TARGET_MODULES:
        raise _reject(
            "target_modules",
            f"must be a list of 1 to {MAX_TARGET_MODULES} module names (a string would be a regular "
            "expression, which the server does not take)",
        )
    for name in value:
        if not (isinstance(name, str) and len(name) <= MAX_MODULE_NAME_CHARS and MODULE_NAME.fullmatch(name)):
            shown = quoted(name) if isinstance(name, str) else type(name).__name__
            raise _reject(
                "target_modules",
                f"{shown} is not a module name (letters, digits, '_', dots between names; "
                f"at most {MAX_MODULE_NAME_CHARS} characters)",
            )
    return sorted(set(value))


def _is_safe_init(value: Any) -> bool:
    # Typed comparison: 1 == True, but 1 is not a PEFT init.
    return any(type(value) is type(safe) and value == safe for safe in SAFE_LORA_INITS)


# The fields a config may set besides target_modules: (accepts the value, what it must be).
FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "r": (lambda v: type(v) is int and 0 < v <= MAX_RANK, f"must be an integer in [1, {MAX_RANK}]"),
    "lora_alpha": (lambda v: _is_number(v) and math.isfinite(v), "must be a finite number"),
    "lora_dropout": (lambda v: _is_number(v) and 0 <= v < 1, "must be a finite number in [0, 1)"),
    "bias": (lambda v: v == "none", 'must be "none": a LoRA update may not change the base biases'),
    "use_rslora": (lambda v: isinstance(v, bool), "must be true or false"),
    "init_lora_weights": (
        _is_safe_init,
        f"must be one of {SAFE_LORA_INITS}: the others rewrite base weights when the adapter is "
        "created (every adapter weight comes from the update anyway)",
    ),
}


def parse_lora_config(text: str) -> LoraConfig:
    """The update's LoraConfig, built from the checked fields only, or InvalidRequest naming the first
    field that is refused."""
    if len(text) > MAX_CONFIG_CHARS:
        raise InvalidRequest([(FIELD, f"is {len(text)} characters; at most {MAX_CONFIG_CHARS}")])
    try:
        values = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise InvalidRequest([(FIELD, f"not JSON: {quoted(str(error))}")]) from error
    if not isinstance(values, dict):
        raise InvalidRequest([(FIELD, "must be a JSON object (a peft LoraConfig's to_dict())")])
    if values.get("peft_type", "LORA") != "LORA":
        raise _reject("peft_type", "must be LORA")
    if "target_modules" not in values:
        raise _reject("target_modules", "is required")
    checked = {}
    for key, value in values.items():
        if key == "target_modules":
            checked[key] = _target_modules(value)
        elif key in FIELD_RULES:
            accepts, rule = FIELD_RULES[key]
            if not accepts(value):
                raise _reject(key, rule)
            checked[key] = value
        elif key in METADATA_FIELDS or key == "peft_type":
            continue
        elif key in PEFT_DEFAULTS:
            default = PEFT_DEFAULTS[key]
            if value != default and not (value in UNSET and default in UNSET):
                raise _reject(key, f"is not supported: it must keep PEFT's default {default!r}")
        elif value not in UNSET:  # a field of a newer PEFT, set
            raise _reject(key, "is not a LoraConfig field the server knows")
    return LoraConfig(**checked)
