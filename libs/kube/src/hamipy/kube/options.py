"""Command-line options from the environment, the same way in every service.

Every flag of a service may come from ``HAMIPY_<SERVICE>_<FLAG>`` (``EnvFlags``): the chart sets
them, a flag on the command line wins. Booleans are strict: ``1/true/yes/on`` or
``0/false/no/off`` (any case), and anything else is refused with the variable's name
(``BadEnvironment``), never quietly read as off. An empty variable is unset, for every kind of flag.
The node agents (device plugin, monitor) share their node options (``add_node_options``):
``--node-name`` (the downward API's ``NODE_NAME``), ``--config`` (``HAMIPY_CONFIG``),
``--kubeconfig`` (``KUBECONFIG``), ``--api-timeout`` and ``--log-level``.

``run_command`` is the shape of every service's ``main``: parse, run, and turn the errors an
operator can act on into one line on stderr and an exit status (2: their input is wrong; 1: it
could not be done), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from hamipy.kube.client import API_TIMEOUT_S
from hamipy.protocol.config import ConfigError

__all__ = [
    "CONFIG_ENV",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "LOG_LEVELS",
    "BadEnvironment",
    "EnvFlags",
    "add_node_options",
    "parse_bool",
    "run_command",
    "with_default_command",
]

CONFIG_ENV: Final = "HAMIPY_CONFIG"
EXIT_FAILED: Final = 1
"""It could not be done (the API, a file, the driver): the message says what."""
EXIT_USAGE: Final = 2
"""The operator's input is wrong (a flag, a variable, the configuration file), as argparse's own."""
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


class BadEnvironment(ValueError):
    """An environment variable holds a value its flag cannot take; the message names both."""


def parse_bool(value: str, *, name: str) -> bool:
    """``value`` as a boolean, or ``BadEnvironment`` naming ``name``."""
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise BadEnvironment(f"{name}={value!r}: expected true or false (1/0, yes/no, on/off)")


class EnvFlags:
    """A service's flag defaults from ``env``: ``HAMIPY_<SERVICE>_<FLAG>`` (``prefix`` is
    ``HAMIPY_<SERVICE>_``)."""

    def __init__(self, env: Mapping[str, str], prefix: str) -> None:
        self.env = env
        self.prefix = prefix

    def name(self, flag: str) -> str:
        """The variable of ``--some-flag``: ``<prefix>SOME_FLAG``."""
        return self.prefix + flag.upper().replace("-", "_")

    def get(self, flag: str, fallback: str | None = None) -> str | None:
        return self.env.get(self.name(flag), fallback)

    def text(self, flag: str, fallback: str) -> str:
        value = self.env.get(self.name(flag))
        return fallback if value is None else value

    def _set(self, flag: str) -> str | None:
        """The variable's value, or None when it is unset or empty (as a chart leaves it)."""
        value = self.env.get(self.name(flag))
        return value if value is not None and value.strip() else None

    def number(self, flag: str, fallback: float) -> float:
        value = self._set(flag)
        if value is None:
            return fallback
        try:
            return float(value)
        except ValueError:
            raise BadEnvironment(f"{self.name(flag)}={value!r}: expected a number") from None

    def integer(self, flag: str, fallback: int) -> int:
        value = self.optional_integer(flag)
        return fallback if value is None else value

    def optional_integer(self, flag: str) -> int | None:
        """An integer flag whose default is "off": None when unset or empty."""
        value = self._set(flag)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise BadEnvironment(f"{self.name(flag)}={value!r}: expected a whole number") from None

    def boolean(self, flag: str, fallback: bool) -> bool:
        value = self._set(flag)
        return fallback if value is None else parse_bool(value, name=self.name(flag))

    def switch(self, parser: argparse.ArgumentParser, flag: str, fallback: bool, *, help: str) -> None:
        """Add ``--flag`` / ``--no-flag`` to ``parser``, defaulting to the variable, else ``fallback``."""
        parser.add_argument(
            f"--{flag}",
            action=argparse.BooleanOptionalAction,
            default=self.boolean(flag, fallback),
            help=help,
        )

    def epilog(self, example: str) -> str:
        """The help text's last line: where else a flag can come from."""
        return f"Every flag can also be set as {self.prefix}<FLAG> (e.g. {self.prefix}{example})."


def add_node_options(
    parser: argparse.ArgumentParser,
    flags: EnvFlags,
    *,
    api_timeout_s: float = API_TIMEOUT_S,
) -> None:
    """The options every node agent has: which node, the shared configuration, the API server."""
    env = flags.env
    parser.add_argument(
        "--node-name",
        default=flags.get("node-name", env.get("NODE_NAME")),
        help="this node's name (env NODE_NAME, from the downward API); required",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=env.get(CONFIG_ENV) or flags.get("config"),
        help=f"shared hami-py configuration (YAML; env {CONFIG_ENV}); defaults apply without one",
    )
    parser.add_argument(
        "--kubeconfig",
        default=env.get("KUBECONFIG") or flags.get("kubeconfig"),
        help="kubeconfig file; default: in-cluster service account, else ~/.kube/config",
    )
    parser.add_argument(
        "--api-timeout",
        type=float,
        default=flags.number("api-timeout", api_timeout_s),
        help="seconds per Kubernetes API call",
    )
    parser.add_argument("--log-level", default=flags.text("log-level", "info"), choices=LOG_LEVELS)


def with_default_command(argv: Sequence[str], commands: Sequence[str], default: str) -> list[str]:
    """``argv`` with ``default`` in front when it names none of ``commands`` (``serve`` is what an
    image runs with flags alone), unless it asks for help or the version."""
    arguments = list(argv)
    if not arguments or arguments[0] not in (*commands, "-h", "--help", "--version"):
        arguments.insert(0, default)
    return arguments


def run_command(
    prog: str,
    *,
    parser: Callable[[], argparse.ArgumentParser],
    argv: Sequence[str],
    run: Callable[[argparse.ArgumentParser, argparse.Namespace], int],
    usage_errors: Mapping[type[Exception], str] | None = None,
    failures: tuple[type[Exception], ...] = (),
) -> int:
    """Build the parser (``BadEnvironment``: exit 2), parse ``argv`` and ``run``. A bad configuration
    file and ``usage_errors`` (error type -> what the message calls it) exit 2, ``failures`` exit 1,
    each with one line naming ``prog`` on stderr; anything else is a bug and keeps its traceback."""
    try:
        built = parser()
    except BadEnvironment as exc:
        print(f"{prog}: bad environment: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args = built.parse_args(list(argv))
    usage: dict[type[Exception], str] = {ConfigError: "bad configuration", **(usage_errors or {})}
    try:
        return run(built, args)
    except tuple(usage) as exc:
        what = next(text for kind, text in usage.items() if isinstance(exc, kind))
        print(f"{prog}: {what}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except failures as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_FAILED
