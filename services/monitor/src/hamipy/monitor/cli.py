"""``hamipy-monitor``: the entry point (wiring only).

    hamipy-monitor --node-name NODE [--config hami-py.yaml] [--kubeconfig FILE] [--hook-path DIR]
                   [--metrics-port 9394] [--legacy-metrics] [--no-feedback] [--feedback-interval 5]

Every flag may also come from the environment (``HAMIPY_MONITOR_<FLAG>``, booleans as
``true``/``false``); the node name also from ``NODE_NAME`` (the downward API), the shared
configuration from ``HAMIPY_CONFIG``. The hook directory defaults to the configuration's
``nvidia.hookPath``. Without ``--kubeconfig`` the in-cluster service account is used, else
``~/.kube/config``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any, Final

from hamipy.monitor.errors import MonitorError
from hamipy.monitor.host_gpus import NvmlHostGpus
from hamipy.monitor.kube import NodePodsApi
from hamipy.monitor.monitor import Monitor
from hamipy.monitor.settings import DEFAULT_METRICS_PORT, MonitorSettings
from hamipy.monitor.telemetry import Telemetry
from hamipy.protocol.config import Config, ConfigError, load_config_file

__all__ = ["build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_MONITOR_"
CONFIG_ENV: Final = "HAMIPY_CONFIG"
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off", ""})


def _flag(value: str | None, name: str, fallback: bool) -> bool:
    if value is None:
        return fallback
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{name}: expected true or false, got {value!r}")


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default)."""
    env = os.environ if env is None else env
    defaults = MonitorSettings(node_name="")

    def default(flag: str, fallback: Any = None) -> Any:
        return env.get(ENV_PREFIX + flag.upper().replace("-", "_"), fallback)

    def boolean(flag: str, fallback: bool) -> bool:
        return _flag(default(flag), ENV_PREFIX + flag.upper().replace("-", "_"), fallback)

    parser = argparse.ArgumentParser(
        prog="hamipy-monitor",
        description=(
            "hami-py node monitor: per-container GPU limits and use from the region files, host GPU "
            "use from NVML, on /metrics for Prometheus; and the priority feedback to the interposer."
        ),
        epilog=f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}LEGACY_METRICS=true).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-monitor')}")
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
        "--hook-path",
        type=Path,
        default=default("hook-path"),
        help="host hook directory holding containers/<podUID>_<container>/*.cache "
        "(default: the configuration's nvidia.hookPath)",
    )
    parser.add_argument("--metrics-host", default=default("metrics-host", defaults.metrics_host))
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(default("metrics-port", DEFAULT_METRICS_PORT)),
        help="/metrics, /healthz, /readyz (HAMi's monitor port by default); 0 picks a free port",
    )
    parser.add_argument(
        "--legacy-metrics",
        action=argparse.BooleanOptionalAction,
        default=boolean("legacy-metrics", defaults.legacy_metrics),
        help="also export HAMi's pre-2.9 metric names for old dashboards",
    )
    parser.add_argument(
        "--host-metrics",
        action=argparse.BooleanOptionalAction,
        default=boolean("host-metrics", defaults.host_metrics),
        help="export host GPU metrics from NVML",
    )
    parser.add_argument(
        "--feedback",
        action=argparse.BooleanOptionalAction,
        default=boolean("feedback", defaults.feedback),
        help="write the priority feedback (recent_kernel, utilization_switch) into region files",
    )
    parser.add_argument(
        "--feedback-interval",
        type=float,
        default=float(default("feedback-interval", defaults.feedback_interval_s)),
        help="seconds between feedback and housekeeping passes",
    )
    parser.add_argument(
        "--gone-grace",
        type=float,
        default=float(default("gone-grace", defaults.gone_grace_s)),
        help="seconds a pod must be gone before its region directories are removed",
    )
    parser.add_argument(
        "--api-timeout",
        type=float,
        default=float(default("api-timeout", defaults.api_timeout_s)),
        help="seconds per Kubernetes API call",
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


def settings_from(args: argparse.Namespace, config: Config) -> MonitorSettings:
    """The monitor's settings from parsed flags and the shared configuration."""
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
        api_timeout_s=args.api_timeout,
    )


async def _run(args: argparse.Namespace) -> int:
    config = Config() if args.config is None else load_config_file(args.config)
    settings = settings_from(args, config)
    telemetry = Telemetry(log_level=getattr(logging, args.log_level.upper()))
    host_gpus = NvmlHostGpus(log=telemetry.log, metrics=telemetry.metrics) if settings.host_metrics else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with await _api_client(args.kubeconfig) as api_client:
        monitor = Monitor(
            settings=settings,
            telemetry=telemetry,
            pods_api=NodePodsApi(api_client, node_name=settings.node_name, timeout_s=settings.api_timeout_s),
            host_gpus=host_gpus,
        )
        # What is loaded by now (modules, above all kubernetes_asyncio's) lives as long as the
        # process: keep the cyclic GC from walking it at every full collection, which otherwise
        # adds ~30 ms to one scrape in a hundred (tests/bench/bench_monitor.py).
        gc.collect()
        gc.freeze()
        await monitor.run(stop)
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    env = os.environ if env is None else env
    try:
        parser = build_parser(env)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        print(f"hamipy-monitor: bad environment: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.node_name:
        parser.error("--node-name (or NODE_NAME) is required")
    if args.feedback_interval <= 0 or args.gone_grace < 0 or args.api_timeout <= 0:
        parser.error("--feedback-interval and --api-timeout must be positive, --gone-grace not negative")
    try:
        return asyncio.run(_run(args))
    except ConfigError as exc:
        print(f"hamipy-monitor: bad configuration: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (MonitorError, OSError) as exc:
        print(f"hamipy-monitor: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
