"""``hamipy-device-plugin``: the entry point (wiring only).

    hamipy-device-plugin --node-name NODE [--config hami-py.yaml] [--kubeconfig FILE]
                         [--plugin-dir /var/lib/kubelet/device-plugins] [--metrics-port 9395]
                         [--interposer /path/to/libvgpu.so]

Every flag may also come from the environment (``HAMIPY_DEVICE_PLUGIN_<FLAG>``); the node name also
from ``NODE_NAME`` (the downward API), the shared configuration from ``HAMIPY_CONFIG``. Without
``--kubeconfig`` the in-cluster service account is used, else ``~/.kube/config``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any, Final

from hamipy.device_plugin.errors import DevicePluginError
from hamipy.device_plugin.plugin import DevicePlugin, install_interposer
from hamipy.device_plugin.settings import DEFAULT_PLUGIN_DIR, DEFAULT_SOCKET_NAME, PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.protocol.config import Config, ConfigError, load_config_file
from hamipy.telemetry import TracingConfigError

__all__ = ["build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_DEVICE_PLUGIN_"
CONFIG_ENV: Final = "HAMIPY_CONFIG"
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default)."""
    env = os.environ if env is None else env

    def default(flag: str, fallback: Any = None) -> Any:
        return env.get(ENV_PREFIX + flag.upper().replace("-", "_"), fallback)

    parser = argparse.ArgumentParser(
        prog="hamipy-device-plugin",
        description="hami-py kubelet device plugin: registers this node's GPUs and serves Allocate.",
        epilog=f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}METRICS_PORT=9395).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-device-plugin')}")
    parser.add_argument(
        "--node-name",
        default=default("node-name", env.get("NODE_NAME")),
        help="this node's name (env NODE_NAME, from the downward API); required",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=env.get(CONFIG_ENV) or default("config"),
        help=f"shared hami-py configuration (YAML; env {CONFIG_ENV}); defaults apply without one",
    )
    parser.add_argument(
        "--kubeconfig",
        default=env.get("KUBECONFIG") or default("kubeconfig"),
        help="kubeconfig file; default: in-cluster service account, else ~/.kube/config",
    )
    parser.add_argument(
        "--plugin-dir",
        type=Path,
        default=Path(default("plugin-dir", str(DEFAULT_PLUGIN_DIR))),
        help="the kubelet's device-plugin directory (kubelet.sock and our socket)",
    )
    parser.add_argument("--socket-name", default=default("socket-name", DEFAULT_SOCKET_NAME))
    parser.add_argument("--metrics-host", default=default("metrics-host", "0.0.0.0"))
    parser.add_argument(
        "--metrics-port", type=int, default=int(default("metrics-port", 9395)), help="0 picks a free port"
    )
    parser.add_argument(
        "--register-interval",
        type=float,
        default=float(default("register-interval", 30.0)),
        help="seconds between node register/handshake writes (keep well under 60)",
    )
    parser.add_argument("--api-timeout", type=float, default=float(default("api-timeout", 10.0)))
    parser.add_argument(
        "--interposer",
        type=Path,
        default=default("interposer"),
        help="libvgpu.so to install with ld.so.preload into the configured hookPath at start",
    )
    parser.add_argument(
        "--log-level", default=default("log-level", "info"), choices=["debug", "info", "warning"]
    )
    return parser


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


async def _run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    config = Config() if args.config is None else load_config_file(args.config)
    settings = PluginSettings(
        node_name=args.node_name,
        plugin_dir=args.plugin_dir,
        socket_name=args.socket_name,
        register_interval_s=args.register_interval,
        api_timeout_s=args.api_timeout,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
    )
    telemetry = Telemetry(log_level=getattr(logging, args.log_level.upper()))
    if args.interposer is not None:
        await asyncio.to_thread(install_interposer, args.interposer, config.nvidia.hook_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with await _api_client(args.kubeconfig) as api_client:
            plugin = DevicePlugin(
                config=config, settings=settings, telemetry=telemetry, api_client=api_client
            )
            await plugin.run(stop)
    finally:
        await asyncio.to_thread(telemetry.shutdown)
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    env = os.environ if env is None else env
    parser = build_parser(env)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.node_name:
        parser.error("--node-name (or NODE_NAME) is required")
    try:
        return asyncio.run(_run(args, env))
    except ConfigError as exc:
        print(f"hamipy-device-plugin: bad configuration: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TracingConfigError as exc:
        print(f"hamipy-device-plugin: bad OpenTelemetry environment: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (DevicePluginError, OSError) as exc:
        print(f"hamipy-device-plugin: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
