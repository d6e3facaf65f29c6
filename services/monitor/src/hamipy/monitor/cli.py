"""``hamipy-monitor``: the entry point (wiring only).

    hamipy-monitor --node-name NODE [--config hami-py.yaml] [--kubeconfig FILE] [--hook-path DIR]
                   [--metrics-port 9394] [--legacy-metrics] [--no-feedback] [--feedback-interval 5]

The flags are the settings declared in ``hamipy.monitor.settings`` and ``ProcessSettings``; each
may also come from the environment (``HAMIPY_MONITOR_<FLAG>``; booleans strictly ``true``/``false``,
``1``/``0``, ``yes``/``no`` or ``on``/``off``, and a value that is not the setting's type is a usage
error), the node name also from ``NODE_NAME`` (the downward API), the shared configuration from
``HAMIPY_CONFIG``; without ``--kubeconfig`` the in-cluster service account is used, else
``~/.kube/config``. The hook directory defaults to the configuration's ``nvidia.hookPath``.

Exit status: 0 when stopped (SIGTERM, SIGINT); 1 when a background task died (logged with its
name); 2 for a usage error (flags, environment, configuration file).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from hamipy.kube.client import RawKube, api_client
from hamipy.kube.errors import KubeError
from hamipy.kube.options import ProcessSettings, command_line, run_command
from hamipy.monitor.errors import MonitorError
from hamipy.monitor.host_gpus import NvmlHostGpus
from hamipy.monitor.monitor import Monitor
from hamipy.monitor.settings import HookPathOverride, MonitorSettings
from hamipy.monitor.telemetry import Telemetry
from hamipy.protocol.config import Config, load_config_file
from hamipy.protocol.settings import Group, settings_from
from hamipy.serving.supervision import serve_until_signal
from hamipy.telemetry import TracingConfigError

__all__ = ["ENV_PREFIX", "SETTINGS", "build_parser", "main", "settings_from_args"]

ENV_PREFIX: Final = "HAMIPY_MONITOR_"
SETTINGS: Final = (
    Group(ProcessSettings, only=("config", "kubeconfig", "log_level")),
    Group(MonitorSettings),
    Group(HookPathOverride),
)


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default). A variable
    that cannot be read as its flag raises ``BadEnvironment``."""
    parser, _ = command_line(
        "hamipy-monitor",
        description=(
            "hami-py node monitor: per-container GPU limits and use from the region files, host GPU "
            "use from NVML, on /metrics for Prometheus; and the priority feedback to the interposer."
        ),
        prefix=ENV_PREFIX,
        env=os.environ if env is None else env,
        settings=SETTINGS,
    )
    return parser


def settings_from_args(args: argparse.Namespace, config: Config) -> MonitorSettings:
    """The monitor's settings from parsed flags and the shared configuration."""
    nvidia = config.nvidia
    hook_path = settings_from(HookPathOverride, args).hook_path
    return settings_from(
        MonitorSettings,
        args,
        hook_path=hook_path if hook_path is not None else Path(nvidia.hook_path),
        cdi_spec_dir=Path(nvidia.cdi_spec_dir) if nvidia.device_list_strategy == "cdi-cri" else None,
    )


async def _run(process: ProcessSettings, args: argparse.Namespace) -> int:
    config = Config() if process.config is None else load_config_file(process.config)
    settings = settings_from_args(args, config)
    telemetry = Telemetry.create(level=getattr(logging, process.log_level.upper()))
    host_gpus = (
        NvmlHostGpus(logger=telemetry.logger, metrics=telemetry.metrics) if settings.host_metrics else None
    )
    async with await api_client(process.kubeconfig) as client:
        monitor = Monitor(settings=settings, telemetry=telemetry, api=RawKube(client), host_gpus=host_gpus)
        # What is loaded by now (modules, above all kubernetes_asyncio's) lives as long as the
        # process: keep the cyclic GC from walking it at every full collection, which would add
        # the walk to the scrape it lands in (the p99 of tests/bench/bench_monitor.py).
        gc.collect()
        gc.freeze()
        return await serve_until_signal(monitor.running(), monitor.supervisor, telemetry.logger)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status (1 when a background task died: its log line
    says which and why)."""

    def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        if args.feedback_interval_s <= 0 or args.gone_grace_s < 0 or args.api_timeout_s <= 0:
            parser.error("--feedback-interval and --api-timeout must be positive, --gone-grace not negative")
        return asyncio.run(_run(settings_from(ProcessSettings, args), args))

    return run_command(
        "hamipy-monitor",
        parser=lambda: build_parser(env),
        argv=sys.argv[1:] if argv is None else argv,
        run=run,
        usage_errors={TracingConfigError: "bad OpenTelemetry environment"},
        failures=(MonitorError, KubeError, OSError),
    )


if __name__ == "__main__":
    sys.exit(main())
