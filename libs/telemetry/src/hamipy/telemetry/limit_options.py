"""The command-line options of ``HttpLimits``, the same in every service that serves HTTP to the
pod network (the webhook, the extender): ``--header-timeout``, ``--body-timeout``,
``--keepalive-timeout``, ``--max-connections``, ``--max-queued-connections``, each also from the
service's environment."""

from __future__ import annotations

import argparse
from typing import Protocol

from hamipy.telemetry.http_limits import HttpLimits

__all__ = ["NumberFlags", "add_limit_options"]


class NumberFlags(Protocol):
    """Where a flag's default comes from (``hamipy.kube.options.EnvFlags``: the environment)."""

    def number(self, flag: str, fallback: float) -> float: ...

    def integer(self, flag: str, fallback: int) -> int: ...


def add_limit_options(parser: argparse.ArgumentParser, flags: NumberFlags, defaults: HttpLimits) -> None:
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=flags.number("header-timeout", defaults.header_timeout_s),
        help="seconds a client gets from connecting (TLS handshake included) to its request headers",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=flags.number("body-timeout", defaults.body_timeout_s),
        help="seconds a client gets from its headers to the end of its body",
    )
    parser.add_argument(
        "--keepalive-timeout",
        type=float,
        default=flags.number("keepalive-timeout", defaults.keepalive_timeout_s),
        help="seconds an idle kept-alive connection stays open",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=flags.integer("max-connections", defaults.max_connections),
        help="connections held at once per port; beyond it the longest idle or slow one is closed",
    )
    parser.add_argument(
        "--max-queued-connections",
        type=int,
        default=flags.integer("max-queued-connections", defaults.max_queued),
        help="connections that wait for a slot when every held one is serving a request (0: none; "
        "a new connection is then closed at once)",
    )
