"""``hamipy-device-plugin``: the entry point (wiring only).

    hamipy-device-plugin --node-name NODE [--config hami-py.yaml] [--kubeconfig FILE]
                         [--plugin-dir /var/lib/kubelet/device-plugins] [--metrics-port 9395]
                         [--pod-resources-socket /var/lib/kubelet/pod-resources/kubelet.sock]
                         [--interposer /path/to/libvgpu.so]

The flags are the settings declared in ``PluginSettings`` and ``ProcessSettings``; each may also
come from the environment (``HAMIPY_DEVICE_PLUGIN_<FLAG>``; a value that is not the setting's type
is a usage error), the node name also from ``NODE_NAME`` (the downward API), the shared
configuration from ``HAMIPY_CONFIG``; without ``--kubeconfig`` the in-cluster service account is
used, else ``~/.kube/config``.

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
from typing import Final

from hamipy.device_plugin.errors import DevicePluginError
from hamipy.device_plugin.plugin import DevicePlugin, install_interposer
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.client import RawKube, api_client
from hamipy.kube.errors import KubeError
from hamipy.kube.options import ProcessSettings, command_line, run_command
from hamipy.protocol.config import Config, load_config_file
from hamipy.protocol.settings import Group, settings_from
from hamipy.serving.supervision import serve_until_signal
from hamipy.telemetry import TracingConfigError

__all__ = ["ENV_PREFIX", "SETTINGS", "build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_DEVICE_PLUGIN_"
SETTINGS: Final = (Group(ProcessSettings, only=("config", "kubeconfig", "log_level")), Group(PluginSettings))


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default). A variable
    that cannot be read as its flag raises ``BadEnvironment``."""
    parser, _ = command_line(
        "hamipy-device-plugin",
        description="hami-py kubelet device plugin: registers this node's GPUs and serves Allocate.",
        prefix=ENV_PREFIX,
        env=os.environ if env is None else env,
        settings=SETTINGS,
    )
    return parser


async def _run(process: ProcessSettings, settings: PluginSettings) -> int:
    config = Config() if process.config is None else load_config_file(process.config)
    telemetry = Telemetry.create(level=getattr(logging, process.log_level.upper()))
    if settings.interposer is not None:
        await asyncio.to_thread(install_interposer, settings.interposer, config.nvidia.hook_path)
    try:
        async with await api_client(process.kubeconfig) as client:
            plugin = DevicePlugin(config=config, settings=settings, telemetry=telemetry, api=RawKube(client))
            return await serve_until_signal(plugin.running(), plugin.supervisor, telemetry.logger)
    finally:
        await asyncio.to_thread(telemetry.shutdown)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status (1 when a background task died: its log line
    says which and why)."""

    def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        settings = settings_from(PluginSettings, args)
        return asyncio.run(_run(settings_from(ProcessSettings, args), settings))

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
