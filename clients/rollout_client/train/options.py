"""Options as dataclass fields: each field carries its flag's help, its rule and its default, the
command line is generated from the fields, and a part checks itself on construction.

A part of the trainer's config is a dataclass of ``Options``; each field made by ``option(...)`` is a
flag (``--`` + ``FLAG_PREFIX`` + its name with dashes, unless ``flag`` names another). Its type gives the
flag's kind: ``bool`` a switch, ``list[str]`` a repeatable flag, ``X | None`` a flag of type ``X`` that
may be left unset. A value no run can train with raises ``ConfigError``, from the command line or
from code alike.
"""

import argparse
import dataclasses
import keyword
import math
import numbers
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from rollout_client.train.config import TrainConfig

# A field's rule: why its value cannot train, or None. NaN fails every comparison, so every numeric
# rule refuses it.
Rule = Callable[[Any], str | None]


def number(must: str, holds: Callable[[Any], bool], integer: bool = False) -> Rule:
    """The rule of a number (an integer where ``integer``) that ``holds``; ``must`` says what it must be."""
    kind = numbers.Integral if integer else numbers.Real

    def problem(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"must be {'an integer' if integer else 'a number'}, got {value!r}"
        return None if holds(value) else f"must be {must}, got {value}"

    return problem


def at_least(minimum: int, why: str = "") -> Rule:
    return number(f"at least {minimum}{why}", lambda value: value >= minimum, integer=True)


def positive(why: str = "") -> Rule:
    return number(f"finite and above 0{why}", lambda value: 0 < value < math.inf)


def parses(parse: Callable[[str], Any]) -> Rule:
    """The rule of a text that ``parse`` takes: its ValueError says why not."""

    def problem(text: str) -> str | None:
        try:
            parse(text)
        except ValueError as error:
            return str(error)
        return None

    return problem


NOT_NEGATIVE = number("finite and at least 0", lambda value: 0 <= value < math.inf)
FRACTION = number("in [0, 1)", lambda value: 0 <= value < 1)
SEED = number("in [0, 2^32)", lambda value: 0 <= value < 2**32, integer=True)


class ConfigError(ValueError):
    """A config no run can train with. ``usage`` is the command line's error for it (what follows
    ``error:``): for a field's own rule ``argument --flag: problem``, while the message names the field
    (``OptimConfig.lr must be ...``); for a rule between fields, the message itself. ``flag`` and
    ``problem`` are set for a field's rule."""

    def __init__(self, message: str, usage: str | None = None):
        super().__init__(message)
        self.usage = usage or message
        self.flag: str | None = None
        self.problem: str | None = None

    @classmethod
    def of_field(cls, part: type["Options"], field: str, problem: str) -> "ConfigError":
        flag = part.flag(field)
        error = cls(f"{part.__name__}.{field} {problem}", f"argument {flag}: {problem}")
        error.flag, error.problem = flag, problem
        return error


def option(
    default: Any = dataclasses.MISSING,
    help: str | None = None,  # noqa: A002 - argparse's name
    *,
    rule: Rule | None = None,
    flag: str | None = None,
    choices: tuple | Callable[[], list] | None = None,
    algorithms: tuple[str, ...] = (),
    operational: bool = False,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A field that is a flag. ``rule`` checks its value (None passes where the type allows it);
    ``choices`` (or a function of none giving them, read when the parser is built) bounds it;
    ``algorithms`` names the ``--algorithm`` values it is for: set to another value than its default
    with another algorithm, the config is refused. An ``operational`` flag does not change what a run
    computes: a resumed run may set it anew."""
    metadata = {
        "help": help,
        "rule": rule,
        "flag": flag,
        "choices": choices,
        "algorithms": algorithms,
        "operational": operational,
    }
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"option": metadata})


@dataclasses.dataclass
class Options:
    """A part of a run's config that checks, on construction, each field's rule, then ``check()``,
    the rules between its own fields."""

    FLAG_PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for field, spec in self.option_fields():
            value = getattr(self, field.name)
            if spec["rule"] is not None and not (value is None and _optional(field)):
                problem = spec["rule"](value)
                if problem is not None:
                    raise ConfigError.of_field(type(self), field.name, problem)
        self.check()

    def check(self) -> None:
        """The rules between this part's fields: raise ``ConfigError``."""

    def conflict(self, config: "TrainConfig", world: int) -> str | None:
        """Why this part does not go with the rest of ``config`` on ``world`` trainer ranks, or None
        (an algorithm's options' rules between flags; ``TrainConfig`` asks each)."""
        return None

    @classmethod
    def option_fields(cls) -> Iterator[tuple[dataclasses.Field, dict]]:
        """The part's flag fields with their specs, in declaration order."""
        for field in dataclasses.fields(cls):
            if "option" in field.metadata:
                yield field, field.metadata["option"]

    @classmethod
    def flag(cls, field: str) -> str:
        spec = next(spec for f, spec in cls.option_fields() if f.name == field)
        return spec["flag"] or "--" + (cls.FLAG_PREFIX + field).replace("_", "-")

    @classmethod
    def dest(cls, field: str) -> str:
        """The flag's name in an argparse namespace and in a checkpoint's settings (``async_``)."""
        name = cls.flag(field)[2:].replace("-", "_")
        return name + "_" if keyword.iskeyword(name) else name

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, title: str) -> None:
        """Each field's flag, in an argument group; the parser's defaults are the fields' defaults."""
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(cls)
        for field, spec in cls.option_fields():
            kind = _flag_type(hints[field.name])
            name, keywords = cls.flag(field.name), {"dest": cls.dest(field.name), "help": spec["help"]}
            if kind is bool:
                group.add_argument(name, action="store_true", **keywords)
                continue
            choices = spec["choices"]() if callable(spec["choices"]) else spec["choices"]
            if choices is None:
                keywords["metavar"] = keywords["dest"].rstrip("_").upper()
            if kind is list:
                group.add_argument(name, action="append", default=[], **keywords)
                continue
            default = None if field.default is dataclasses.MISSING else field.default
            group.add_argument(name, type=kind, choices=choices, default=default, **keywords)

    @classmethod
    def of_flags(cls, flags: argparse.Namespace, **others: Any) -> "Options":
        """The part of parsed flags (``others`` sets its fields that are not flags)."""
        values = {field.name: getattr(flags, cls.dest(field.name)) for field, _ in cls.option_fields()}
        return cls(**values, **others)

    @classmethod
    def documented(cls) -> Iterator[tuple[str, str, str]]:
        """(flag, default, help) of each field, as docs/training.md's flag table shows them."""
        for field, spec in cls.option_fields():
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            shown = "" if default is None or default is False or default in ([], "") else f"`{default}`"
            choices = spec["choices"]() if callable(spec["choices"]) else spec["choices"]
            what = (spec["help"] or "").replace("|", "\\|")
            if choices:
                what += f"{'; ' if what else ''}one of {', '.join(f'`{choice}`' for choice in choices)}"
            yield cls.flag(field.name), shown, what

    def settings(self) -> dict[str, Any]:
        """The value of each flag that decides what a run computes, by ``dest``, as a checkpoint
        records it (a part whose field stands for a default resolves it here)."""
        return {
            self.dest(field.name): getattr(self, field.name)
            for field, spec in self.option_fields()
            if not spec["operational"]
        }

    def flags_set(self, *fields: str) -> list[str]:
        """The flags of ``fields`` that are set (true, non-zero, not empty)."""
        return [self.flag(field) for field in fields if getattr(self, field)]

    def off_algorithm(self, algorithm: str) -> str | None:
        """Why a flag of this part set away from its default is not for ``algorithm``, or None."""
        for field, spec in self.option_fields():
            for_others = spec["algorithms"] and algorithm not in spec["algorithms"]
            if for_others and getattr(self, field.name) != field.default:
                return f"{self.flag(field.name)} is for --algorithm {' or '.join(spec['algorithms'])}"
        return None


def _optional(field: dataclasses.Field) -> bool:
    return type(None) in typing.get_args(field.type)


def _flag_type(hint: Any) -> type:
    """The argparse type of a field's type hint: ``X | None`` is X's; ``list[...]`` is list."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is list:
        return list
    if hint not in (bool, int, float, str, Path):
        raise TypeError(f"no flag type for {hint!r}")
    return hint
