"""``hamipy-extender``: the entry point (wiring only).

    hamipy-extender [serve] [--config hami-py.yaml] [--kubeconfig FILE] [--port 8888] [--cooperative]
                    [--release-lock-after-bind | --no-release-lock-after-bind] [--tls-cert-file ...]
    hamipy-extender check [--kubeconfig FILE]      # the invariant against the cluster; exit 1 if broken

Every flag may also come from the environment (``HAMIPY_EXTENDER_<FLAG>``, e.g.
``HAMIPY_EXTENDER_PORT=9443``); the shared configuration file from ``--config`` or ``HAMIPY_CONFIG``.
Without ``--kubeconfig`` the in-cluster service account is used, else ``~/.kube/config``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import ssl
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any, Final

from hamipy.extender.errors import KubeError
from hamipy.extender.invariant import check_cluster
from hamipy.extender.kube import ApiClientKube
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.protocol.config import Config, ConfigError, load_config_file
from hamipy.telemetry import TracingConfigError

__all__ = ["build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_EXTENDER_"
CONFIG_ENV: Final = "HAMIPY_CONFIG"
_COMMANDS: Final = ("serve", "check")
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
_DEFAULTS: Final = ExtenderSettings()


def _env(env: Mapping[str, str], flag: str, default: Any) -> Any:
    return env.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def _bool_env(env: Mapping[str, str], flag: str, default: bool) -> bool:
    value = _env(env, flag, None)
    if value is None:
        return default
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="hamipy-extender",
        description="hami-py scheduler extender: GPU-aware /filter, /prioritize and /bind.",
        epilog=f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT=9443).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-extender')}")
    commands = parser.add_subparsers(dest="command", metavar="{serve,check}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            type=Path,
            default=env.get(CONFIG_ENV) or _env(env, "config", None),
            help=f"shared hami-py configuration (YAML; env {CONFIG_ENV}); defaults apply without one",
        )
        p.add_argument(
            "--kubeconfig",
            default=env.get("KUBECONFIG") or _env(env, "kubeconfig", None),
            help="kubeconfig file; default: in-cluster service account, else ~/.kube/config",
        )
        p.add_argument(
            "--api-timeout",
            type=float,
            default=_env(env, "api-timeout", _DEFAULTS.api_timeout_s),
            help="seconds per Kubernetes API call",
        )

    serve = commands.add_parser("serve", help="serve the extender (the default command)")
    common(serve)
    serve.add_argument("--host", default=_env(env, "host", "0.0.0.0"), help="listen address")
    serve.add_argument("--port", type=int, default=_env(env, "port", "8888"), help="listen port")
    serve.add_argument(
        "--tls-cert-file", type=Path, default=_env(env, "tls-cert-file", None), help="PEM cert (HTTPS)"
    )
    serve.add_argument(
        "--tls-key-file", type=Path, default=_env(env, "tls-key-file", None), help="PEM key (HTTPS)"
    )
    serve.add_argument(
        "--cooperative",
        action=argparse.BooleanOptionalAction,
        default=_bool_env(env, "cooperative", _DEFAULTS.cooperative),
        help="/filter returns every feasible node and /prioritize scores them (GPUs chosen at bind)",
    )
    serve.add_argument(
        "--release-lock-after-bind",
        action=argparse.BooleanOptionalAction,
        default=_bool_env(env, "release-lock-after-bind", _DEFAULTS.release_lock_after_bind),
        help="hold the node lock only while binding (default); --no-... leaves it for the device plugin "
        "to release after Allocate (HAMi-compatible)",
    )
    serve.add_argument(
        "--bind-timeout",
        type=float,
        default=_env(env, "bind-timeout", _DEFAULTS.bind_timeout_s),
        help="seconds a bind waits for a locked node (keep below the scheduler's httpTimeout)",
    )
    serve.add_argument(
        "--lock-expiry",
        type=float,
        default=_env(env, "lock-expiry", _DEFAULTS.lock_expiry.total_seconds()),
        help="seconds after which any node lock is broken",
    )
    serve.add_argument(
        "--reservation-ttl",
        type=float,
        default=_env(env, "reservation-ttl", _DEFAULTS.reservation_ttl_s),
        help="seconds a filter's reservation counts without a bind",
    )
    serve.add_argument(
        "--handshake-interval",
        type=float,
        default=_env(env, "handshake-interval", _DEFAULTS.handshake_interval_s),
        help="seconds between Requesting_ handshake stamps on nodes (0: off)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=_env(env, "max-body-bytes", _DEFAULTS.max_body_bytes),
        help="largest request body (larger: HTTP 400)",
    )
    serve.add_argument(
        "--log-level", default=_env(env, "log-level", "info"), choices=["debug", "info", "warning", "error"]
    )

    check = commands.add_parser(
        "check", help="check the GPU invariant against the cluster (JSON; exit 1 if broken)"
    )
    common(check)
    return parser


def settings_from_args(args: argparse.Namespace) -> ExtenderSettings:
    """The serve flags as ``ExtenderSettings``."""
    return dataclasses.replace(
        _DEFAULTS,
        cooperative=bool(args.cooperative),
        release_lock_after_bind=bool(args.release_lock_after_bind),
        bind_timeout_s=float(args.bind_timeout),
        lock_expiry=timedelta(seconds=float(args.lock_expiry)),
        reservation_ttl_s=float(args.reservation_ttl),
        handshake_interval_s=float(args.handshake_interval),
        api_timeout_s=float(args.api_timeout),
        max_body_bytes=int(args.max_body_bytes),
    )


async def _api_client(kubeconfig: str | None) -> Any:
    from kubernetes_asyncio import client, config

    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig)
    else:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            await config.load_kube_config()
    return client.ApiClient()


async def _serve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    config = Config() if args.config is None else load_config_file(args.config)
    settings = settings_from_args(args)
    telemetry = Telemetry.create(level=getattr(logging, args.log_level.upper()))
    context = None
    if args.tls_cert_file or args.tls_key_file:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(args.tls_cert_file, args.tls_key_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with await _api_client(args.kubeconfig) as api_client:
        server = ExtenderServer(
            config=config,
            settings=settings,
            telemetry=telemetry,
            api=ApiClientKube(api_client),
            host=args.host,
            port=args.port,
            ssl_context=context,
        )
        async with server:
            await stop.wait()
            telemetry.logger.info("stopping on signal")
    return 0


async def _check(args: argparse.Namespace) -> int:
    async with await _api_client(args.kubeconfig) as api_client:
        report = await check_cluster(ApiClientKube(api_client), timeout_s=float(args.api_timeout) * 3)
    print(json.dumps(report.as_dict(), indent=2))
    return 0 if report.ok else EXIT_FAILED


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    env = os.environ if env is None else env
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or (arguments[0] not in _COMMANDS and arguments[0] not in ("-h", "--help", "--version")):
        arguments.insert(0, "serve")
    args = build_parser(env).parse_args(arguments)
    try:
        if args.command == "check":
            return asyncio.run(_check(args))
        return asyncio.run(_serve(args, env))
    except ConfigError as exc:
        print(f"hamipy-extender: bad configuration: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TracingConfigError as exc:
        print(f"hamipy-extender: bad OpenTelemetry environment: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (KubeError, OSError, ssl.SSLError) as exc:
        print(f"hamipy-extender: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
