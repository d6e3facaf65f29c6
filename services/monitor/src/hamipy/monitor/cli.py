"""``hamipy-monitor``: the entry point (wiring only).

    hamipy-monitor --node-name NODE [--config hami-py.yaml] [--kubeconfig FILE] [--hook-path DIR]
                   [--metrics-port 9394] [--legacy-metrics] [--no-feedback] [--feedback-interval 5]

Every flag may also come from the environment (``HAMIPY_MONITOR_<FLAG>``; booleans strictly
``true``/``false``, ``1``/``0``, ``yes``/``no`` or ``on``/``off``, and a value that is not the flag's
type is a usage error). The node options are the node agents' shared ones
(``hamipy.kube.options.add_node_options``): the node name also from ``NODE_NAME`` (the downward
API), the shared configuration from ``HAMIPY_CONFIG``; without ``--kubeconfig`` the in-cluster
service account is used, else ``~/.kube/config``. The hook directory defaults to the configuration's
``nvidia.hookPath``.

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
from importlib.metadata import version
from pathlib import Path
from typing import Final

from hamipy.kube.client import RawKube, api_client
from hamipy.kube.errors import KubeError
from hamipy.kube.options import (
    EnvFlags,
    add_node_options,
    run_command,
)
from hamipy.monitor.errors import MonitorError
from hamipy.monitor.host_gpus import NvmlHostGpus
from hamipy.monitor.monitor import Monitor
from hamipy.monitor.settings import DEFAULT_METRICS_PORT, MonitorSettings
from hamipy.monitor.telemetry import Telemetry
from hamipy.protocol.config import Config, load_config_file
from hamipy.telemetry import TracingConfigError
from hamipy.telemetry.supervision import serve_until_signal

__all__ = ["build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_MONITOR_"


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default). A variable
    that cannot be read as its flag raises ``BadEnvironment``."""
    flags = EnvFlags(os.environ if env is None else env, ENV_PREFIX)
    defaults = MonitorSettings(node_name="")
    parser = argparse.ArgumentParser(
        prog="hamipy-monitor",
        description=(
            "hami-py node monitor: per-container GPU limits and use from the region files, host GPU "
            "use from NVML, on /metrics for Prometheus; and the priority feedback to the interposer."
        ),
        epilog=flags.epilog("LEGACY_METRICS=true"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-monitor')}")
    add_node_options(parser, flags, api_timeout_s=defaults.api_timeout_s)
    parser.add_argument(
        "--hook-path",
        type=Path,
        default=flags.get("hook-path"),
        help="host hook directory holding containers/<podUID>_<container>/*.cache "
        "(default: the configuration's nvidia.hookPath)",
    )
    parser.add_argument("--metrics-host", default=flags.text("metrics-host", defaults.metrics_host))
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=flags.integer("metrics-port", DEFAULT_METRICS_PORT),
        help="/metrics, /healthz, /readyz (HAMi's monitor port by default); 0 picks a free port",
    )
    flags.switch(
        parser,
        "legacy-metrics",
        defaults.legacy_metrics,
        help="also export HAMi's pre-2.9 metric names for old dashboards",
    )
    flags.switch(
        parser,
        "host-metrics",
        defaults.host_metrics,
        help="export host GPU metrics from NVML",
    )
    flags.switch(
        parser,
        "feedback",
        defaults.feedback,
        help="write the priority feedback (recent_kernel, utilization_switch) into region files",
    )
    parser.add_argument(
        "--feedback-interval",
        type=float,
        default=flags.number("feedback-interval", defaults.feedback_interval_s),
        help="seconds between feedback and housekeeping passes",
    )
    parser.add_argument(
        "--gone-grace",
        type=float,
        default=flags.number("gone-grace", defaults.gone_grace_s),
        help="seconds a pod must be gone before its region directories (and CDI specs) are removed",
    )
    return parser


def settings_from(args: argparse.Namespace, config: Config) -> MonitorSettings:
    """The monitor's settings from parsed flags and the shared configuration."""
    nvidia = config.nvidia
    return MonitorSettings(
        node_name=args.node_name,
        hook_path=args.hook_path if args.hook_path is not None else Path(config.nvidia.hook_path),
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        legacy_metrics=args.legacy_metrics,
        host_metrics=args.host_metrics,
        feedback=args.feedback,
        feedback_interval_s=args.feedback_interval,
        gone_grace_s=args.gone_grace,
        cdi_spec_dir=Path(nvidia.cdi_spec_dir) if nvidia.device_list_strategy == "cdi-cri" else None,
        api_timeout_s=args.api_timeout,
    )


async def _run(args: argparse.Namespace) -> int:
    config = Config() if args.config is None else load_config_file(args.config)
    settings = settings_from(args, config)
    telemetry = Telemetry.create(level=getattr(logging, args.log_level.upper()))
    host_gpus = (
        NvmlHostGpus(logger=telemetry.logger, metrics=telemetry.metrics) if settings.host_metrics else None
    )
    async with await api_client(args.kubeconfig) as client:
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
        if not args.node_name:
            parser.error("--node-name (or NODE_NAME) is required")
        if args.feedback_interval <= 0 or args.gone_grace < 0 or args.api_timeout <= 0:
            parser.error("--feedback-interval and --api-timeout must be positive, --gone-grace not negative")
        return asyncio.run(_run(args))

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
