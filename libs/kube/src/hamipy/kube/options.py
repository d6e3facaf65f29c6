"""Command-line options from the environment, the same way in every service.

Every flag of a service may come from ``HAMIPY_<SERVICE>_<FLAG>`` (``EnvFlags``): the chart sets
them, a flag on the command line wins. Booleans are strict: ``1/true/yes/on`` or
``0/false/no/off`` (any case), and anything else is refused with the variable's name (``BadEnvironment``),
never quietly read as off. The node agents (device plugin, monitor) share their node options
(``add_node_options``): ``--node-name`` (the downward API's ``NODE_NAME``), ``--config``
(``HAMIPY_CONFIG``), ``--kubeconfig`` (``KUBECONFIG``), ``--api-timeout`` and ``--log-level``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from hamipy.kube.client import API_TIMEOUT_S

__all__ = [
    "CONFIG_ENV",
    "LOG_LEVELS",
    "BadEnvironment",
    "EnvFlags",
    "add_node_options",
    "parse_bool",
]

CONFIG_ENV: Final = "HAMIPY_CONFIG"
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

    def number(self, flag: str, fallback: float) -> float:
        value = self.env.get(self.name(flag))
        if value is None:
            return fallback
        try:
            return float(value)
        except ValueError:
            raise BadEnvironment(f"{self.name(flag)}={value!r}: expected a number") from None

    def integer(self, flag: str, fallback: int) -> int:
        value = self.env.get(self.name(flag))
        if value is None:
            return fallback
        try:
            return int(value)
        except ValueError:
            raise BadEnvironment(f"{self.name(flag)}={value!r}: expected a whole number") from None

    def boolean(self, flag: str, fallback: bool) -> bool:
        value = self.env.get(self.name(flag))
        return fallback if value is None or not value.strip() else parse_bool(value, name=self.name(flag))

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
