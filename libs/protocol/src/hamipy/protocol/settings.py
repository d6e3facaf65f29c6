"""Each service's settings, declared once: a field of a frozen settings dataclass whose metadata
(``user`` / ``tuning`` / ``declare``) says its flag, its help, the variables it may come from and
whether users set it or it is a tuning knob. The command-line flags, the environment names, the
table in docs/configuration.md and the chart's pass-through are all generated or checked from it.

Reading, the same in every service: a flag on the command line wins; else the first of its
variables that is set (by default ``<prefix><FLAG>``, e.g. ``HAMIPY_EXTENDER_BIND_TIMEOUT``; a
setting may name others, such as the downward API's ``NODE_NAME``); else its default. An empty
variable is unset. A variable its setting cannot take (``maybe`` for a boolean, ``ninety`` for a
port) is refused naming it (``BadEnvironment``), never read as a default. Booleans are
``1/true/yes/on`` or ``0/false/no/off`` (any case) and get ``--flag`` / ``--no-flag``; times in
seconds (fields ending ``_s``, or a ``timedelta``) are given in seconds. A field whose type is
itself a declared dataclass (``HttpLimits`` inside a server's settings) contributes its own settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

__all__ = [
    "OWN",
    "BadEnvironment",
    "Declared",
    "Group",
    "Kind",
    "Setting",
    "add_settings",
    "declare",
    "declared",
    "settings_from",
    "tuning",
    "user",
]

T = TypeVar("T")
Kind = Literal["user", "tuning"]
"""``user``: what an admin sets (the chart passes some); ``tuning``: a knob whose default fits, which
the chart never sets (``extraArgs`` / ``extraEnv`` reach it)."""
OWN: Final = ""
"""In ``Setting.env``: the service's own variable, ``<prefix><FLAG>``."""
_KEY: Final = "hamipy.setting"
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


class BadEnvironment(ValueError):
    """An environment variable holds a value its setting cannot take; the message names both."""


def _parse_bool(value: str, *, name: str) -> bool:
    """``value`` as a boolean, or ``BadEnvironment`` naming ``name``."""
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise BadEnvironment(f"{name}={value!r}: expected true or false (1/0, yes/no, on/off)")


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """How a settings field is set from outside the process."""

    help: str
    kind: Kind
    flag: str = ""
    """Without the dashes; empty: the field's name without a ``_s`` unit, ``_`` as ``-``."""
    env: tuple[str, ...] = (OWN,)
    """The variables read, the first one set winning (``OWN``: ``<prefix><FLAG>``)."""
    choices: tuple[str, ...] = ()


def declare(
    help: str, *, kind: Kind, flag: str = "", env: tuple[str, ...] = (OWN,), choices: tuple[str, ...] = ()
) -> Mapping[str, Setting]:
    """The metadata of a declared field, for ``dataclasses.field(metadata=...)`` (a field with no
    default: a required setting)."""
    return {_KEY: Setting(help=help, kind=kind, flag=flag, env=env, choices=choices)}


def user(
    default: T, help: str, *, flag: str = "", env: tuple[str, ...] = (OWN,), choices: tuple[str, ...] = ()
) -> T:
    """A field that users set."""
    metadata = declare(help, kind="user", flag=flag, env=env, choices=choices)
    return dataclasses.field(default=default, metadata=metadata)


def tuning(default: T, help: str, *, flag: str = "") -> T:
    """A tuning knob: its default fits, and the chart never sets it."""
    return dataclasses.field(default=default, metadata=declare(help, kind="tuning", flag=flag))


@dataclasses.dataclass(frozen=True, slots=True)
class Declared:
    """One setting as the command line and the environment see it."""

    dest: str
    """Where the parsed value lands: the field's name, ``outer.inner`` for a nested group's."""
    flag: str
    setting: Setting
    value_type: type
    """``bool``, ``int``, ``float``, ``str``, ``Path`` or ``timedelta``; ``X | None`` is read as ``X``."""
    default: object
    """``dataclasses.MISSING`` for a required setting."""

    def variables(self, prefix: str) -> tuple[str, ...]:
        own = prefix + self.flag.upper().replace("-", "_")
        return tuple(own if name == OWN else name for name in self.setting.env)


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    """The settings of ``cls`` one command takes: all, or the fields named in ``only``."""

    cls: type
    only: Collection[str] = ()

    def declared(self) -> Iterator[Declared]:
        for item in declared(self.cls):
            if not self.only or item.dest.partition(".")[0] in self.only:
                yield item


def declared(cls: type, *, outer: str = "") -> Iterator[Declared]:
    """The declared settings of the dataclass ``cls``, in field order; a field whose type is a
    declared dataclass gives its own (``dest`` prefixed with the field's name)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        value_type = _value_type(hints[field.name])
        if isinstance(value_type, type) and dataclasses.is_dataclass(value_type):
            yield from declared(value_type, outer=f"{outer}{field.name}.")
            continue
        setting = field.metadata.get(_KEY)
        if setting is None:
            continue
        flag = setting.flag or field.name.removesuffix("_s").replace("_", "-")
        yield Declared(outer + field.name, flag, setting, value_type, field.default)


def _value_type(hint: Any) -> Any:
    """The type of a field's annotation, ``X`` of ``X | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (kind,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return kind
    return hint


def _seconds(text: str) -> timedelta:
    return timedelta(seconds=float(text))


_PARSERS: Final[Mapping[type, tuple[Callable[[str], Any], str]]] = {
    int: (int, "a whole number"),
    float: (float, "a number"),
    timedelta: (_seconds, "a number of seconds"),
    Path: (Path, "a path"),
    str: (str, "text"),
}


def _from_env(item: Declared, env: Mapping[str, str], prefix: str) -> object:
    """The value the environment gives ``item``, else its default (None when there is none)."""
    for name in item.variables(prefix):
        text = env.get(name)
        if text is None or not text.strip():
            continue
        if item.value_type is bool:
            return _parse_bool(text, name=name)
        parse, expected = _PARSERS[item.value_type]
        try:
            value = parse(text)
        except ValueError:
            raise BadEnvironment(f"{name}={text!r}: expected {expected}") from None
        if item.setting.choices and value not in item.setting.choices:
            raise BadEnvironment(f"{name}={text!r}: expected one of {', '.join(item.setting.choices)}")
        return value
    return None if item.default is dataclasses.MISSING else item.default


def add_settings(
    parser: argparse.ArgumentParser, *groups: Group, env: Mapping[str, str], prefix: str
) -> None:
    """A flag on ``parser`` for every setting of ``groups``, defaulting to what ``env`` holds for
    it (``prefix``: the service's, ``HAMIPY_<SERVICE>_``), else to its declared default; a required
    one that none of its variables gives must be on the command line. ``BadEnvironment`` when a
    variable holds what its setting cannot take."""
    for group in groups:
        for item in group.declared():
            names = ", ".join(item.variables(prefix))
            default = _from_env(item, env, prefix)
            options: dict[str, Any] = {
                "dest": item.dest,
                "default": default,
                "required": item.default is dataclasses.MISSING and default is None,
                "help": f"{item.setting.help} [env {names}]",
            }
            if item.value_type is bool:
                options["action"] = argparse.BooleanOptionalAction
            elif item.setting.choices:
                options["choices"] = item.setting.choices
            else:
                options["type"] = _PARSERS[item.value_type][0]
                options["metavar"] = item.flag.rpartition("-")[2].upper()
            parser.add_argument(f"--{item.flag}", **options)


def settings_from(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``cls`` from the parsed flags (``add_settings``) and ``given`` for the fields no flag sets;
    a field neither gives keeps its default. ``ValueError`` when ``cls`` refuses a value (its
    ``__post_init__``)."""
    return _build(cls, args, "", given)


def _build(cls: type[T], args: argparse.Namespace, outer: str, given: Mapping[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        dest = outer + field.name
        value_type = _value_type(hints[field.name])
        if field.name in given:
            values[field.name] = given[field.name]
        elif (
            isinstance(value_type, type)
            and dataclasses.is_dataclass(value_type)
            and any(hasattr(args, item.dest) for item in declared(value_type, outer=f"{dest}."))
        ):
            values[field.name] = _build(value_type, args, f"{dest}.", {})
        elif hasattr(args, dest):
            values[field.name] = getattr(args, dest)
    return cls(**values)
