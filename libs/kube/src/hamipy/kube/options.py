"""The command line, the same way in every service.

Each service declares its settings once (``hamipy.protocol.settings``): every flag may also come
from ``HAMIPY_<SERVICE>_<FLAG>`` (the chart sets some), a flag on the command line wins, and a
variable its setting cannot take is refused naming it (``BadEnvironment``). ``ProcessSettings`` are
what a service's process reads beside its own settings: the shared configuration
(``HAMIPY_CONFIG``), the kubeconfig (``KUBECONFIG``), the log level and the API connections.

``run_command`` is the shape of every service's ``main``: parse, run, and turn the errors an
operator can act on into one line on stderr and an exit status (2: their input is wrong; 1: it
could not be done), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Final

from hamipy.kube.client import MAX_CONNECTIONS
from hamipy.protocol.config import ConfigError
from hamipy.protocol.settings import OWN, BadEnvironment, Group, add_settings, tuning, user

__all__ = [
    "CONFIG_ENV",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "LOG_LEVELS",
    "Command",
    "ProcessSettings",
    "command_line",
    "run_command",
    "with_default_command",
]

CONFIG_ENV: Final = "HAMIPY_CONFIG"
EXIT_FAILED: Final = 1
"""It could not be done (the API, a file, the driver): the message says what."""
EXIT_USAGE: Final = 2
"""The operator's input is wrong (a flag, a variable, the configuration file), as argparse's own."""
LOG_LEVELS: Final = ("debug", "info", "warning", "error")


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessSettings:
    """What every service's process reads beside its own settings."""

    config: Path | None = user(
        None,
        "shared hami-py configuration file (YAML); defaults apply without one",
        env=(CONFIG_ENV, OWN),
    )
    kubeconfig: str | None = user(
        None,
        "kubeconfig file; default: in-cluster service account, else ~/.kube/config",
        env=("KUBECONFIG", OWN),
    )
    log_level: str = user("info", "least level of the log lines written", choices=LOG_LEVELS)
    api_connections: int = tuning(
        MAX_CONNECTIONS,
        "connections to the API server at once (its watches and the calls in flight, a bind's "
        "Binding among them)",
    )

    def __post_init__(self) -> None:
        if self.api_connections < 1:  # aiohttp would read 0 as no limit at all
            raise ValueError(f"--api-connections must be at least 1 (got {self.api_connections})")


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    """One command of a service: its help and the settings it takes."""

    help: str
    settings: tuple[Group, ...]


def command_line(
    prog: str,
    *,
    description: str,
    prefix: str,
    env: Mapping[str, str],
    settings: tuple[Group, ...] = (),
    commands: Mapping[str, Command] | None = None,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """A service's parser with ``--version`` (its distribution's, named ``prog``) and its
    ``settings``, or one sub-parser per command with that command's (each returned by name, for
    the arguments that are no settings). Defaults come from ``env`` (``prefix``: the service's
    ``HAMIPY_<SERVICE>_``); ``BadEnvironment`` when a variable holds what its setting cannot take."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every flag can also be set as {prefix}<FLAG>; a flag given here wins.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version(prog)}")
    add_settings(parser, *settings, env=env, prefix=prefix)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    if commands:
        choices = parser.add_subparsers(dest="command", metavar="{" + ",".join(commands) + "}")
        for name, command in commands.items():
            subparsers[name] = choices.add_parser(name, help=command.help)
            add_settings(subparsers[name], *command.settings, env=env, prefix=prefix)
    return parser, subparsers


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
