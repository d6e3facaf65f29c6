"""``hamipy-device-plugin``: the entry point (wiring only).

    hamipy-device-plugin --node-name NODE [--config hami-py.yaml] [--kubeconfig FILE]
                         [--plugin-dir /var/lib/kubelet/device-plugins] [--metrics-port 9395]
                         [--pod-resources-socket /var/lib/kubelet/pod-resources/kubelet.sock]
                         [--interposer /path/to/libvgpu.so]

Every flag may also come from the environment (``HAMIPY_DEVICE_PLUGIN_<FLAG>``; a value that is not
the flag's type is a usage error); the node options are the node agents' shared ones
(``hamipy.kube.options.add_node_options``): the node name also from ``NODE_NAME`` (the downward API),
the shared configuration from ``HAMIPY_CONFIG``; without ``--kubeconfig`` the in-cluster service
account is used, else ``~/.kube/config``.

Exit status: 0 when stopped (SIGTERM, SIGINT); 1 when a background task died (logged with its
name) or the plugin could not start (no NVML...); 2 for a usage error (flags, environment,
configuration file).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Final

from hamipy.device_plugin.errors import DevicePluginError
from hamipy.device_plugin.plugin import DevicePlugin, install_interposer
from hamipy.device_plugin.settings import (
    DEFAULT_PLUGIN_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_SOCKET_NAME,
    PluginSettings,
)
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.client import RawKube, api_client
from hamipy.kube.errors import KubeError
from hamipy.kube.options import (
    EnvFlags,
    add_node_options,
    run_command,
)
from hamipy.protocol.config import Config, load_config_file
from hamipy.telemetry import TracingConfigError
from hamipy.telemetry.supervision import serve_until_signal

__all__ = ["build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_DEVICE_PLUGIN_"


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default). A variable
    that cannot be read as its flag raises ``BadEnvironment``."""
    flags = EnvFlags(os.environ if env is None else env, ENV_PREFIX)
    defaults = PluginSettings(node_name="")
    parser = argparse.ArgumentParser(
        prog="hamipy-device-plugin",
        description="hami-py kubelet device plugin: registers this node's GPUs and serves Allocate.",
        epilog=flags.epilog("METRICS_PORT=9395"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-device-plugin')}")
    add_node_options(parser, flags, api_timeout_s=defaults.api_timeout_s)
    parser.add_argument(
        "--plugin-dir",
        type=Path,
        default=Path(flags.text("plugin-dir", str(DEFAULT_PLUGIN_DIR))),
        help="the kubelet's device-plugin directory (kubelet.sock and our socket)",
    )
    parser.add_argument("--socket-name", default=flags.text("socket-name", DEFAULT_SOCKET_NAME))
    parser.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=Path(flags.text("pod-resources-socket", str(DEFAULT_POD_RESOURCES_SOCKET))),
        help="the kubelet's PodResources API socket: which pod it is admitting, asked at every Allocate",
    )
    parser.add_argument("--metrics-host", default=flags.text("metrics-host", defaults.metrics_host))
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=flags.integer("metrics-port", defaults.metrics_port),
        help="0 picks a free port",
    )
    parser.add_argument(
        "--register-interval",
        type=float,
        default=flags.number("register-interval", defaults.register_interval_s),
        help="seconds between node register/handshake writes (keep well under 60)",
    )
    parser.add_argument(
        "--interposer",
        type=Path,
        default=flags.get("interposer"),
        help="libvgpu.so to install with ld.so.preload into the configured hookPath at start",
    )
    return parser


async def _run(args: argparse.Namespace) -> int:
    config = Config() if args.config is None else load_config_file(args.config)
    settings = PluginSettings(
        node_name=args.node_name,
        plugin_dir=args.plugin_dir,
        socket_name=args.socket_name,
        pod_resources_socket=args.pod_resources_socket,
        register_interval_s=args.register_interval,
        api_timeout_s=args.api_timeout,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
    )
    telemetry = Telemetry.create(level=getattr(logging, args.log_level.upper()))
    if args.interposer is not None:
        await asyncio.to_thread(install_interposer, args.interposer, config.nvidia.hook_path)
    try:
        async with await api_client(args.kubeconfig) as client:
            plugin = DevicePlugin(config=config, settings=settings, telemetry=telemetry, api=RawKube(client))
            return await serve_until_signal(plugin.running(), plugin.supervisor, telemetry.logger)
    finally:
        await asyncio.to_thread(telemetry.shutdown)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status (1 when a background task died: its log line
    says which and why)."""

    def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        if not args.node_name:
            parser.error("--node-name (or NODE_NAME) is required")
        return asyncio.run(_run(args))

    return run_command(
        "hamipy-device-plugin",
        parser=lambda: build_parser(env),
        argv=sys.argv[1:] if argv is None else argv,
        run=run,
        usage_errors={TracingConfigError: "bad OpenTelemetry environment"},
        failures=(DevicePluginError, KubeError, OSError),
    )


if __name__ == "__main__":
    sys.exit(main())
