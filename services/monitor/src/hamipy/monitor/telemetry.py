"""Logs and the monitor's own metrics (docs/design.md#8-observable-by-default), with no module-level state.

The GPU usage metrics (HAMi's names) are made at scrape time by ``collector.UsageCollector``; the
counters here are the monitor's account of itself, on the same per-instance ``CollectorRegistry``:

- ``hamipy_monitor_scrape_duration_seconds``: one ``/metrics`` render, file reads and NVML included.
- ``hamipy_monitor_region_errors_total{reason}``: region files found unreadable (counted when a file
  turns bad or changes reason, not on every scrape; the current count is ``hamipy_monitor_region_files``).
- ``hamipy_monitor_malformed_annotations_total{field}``: pod annotations that could not be decoded.
- ``hamipy_monitor_region_dirs_removed_total``: region directories of pods gone past the grace period.
- ``hamipy_monitor_cdi_specs_removed_total``: CDI spec files of slots whose pods are gone past it.
- ``hamipy_monitor_feedback_writes_total{field}``: priority feedback writes into region files.
- ``hamipy_monitor_nvml_errors_total{call}``: NVML calls that failed.
- ``hamipy_monitor_watch_restarts_total{cause}``: pod list+watch restarts (gone, error, closed).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram

from hamipy.monitor.region_dirs import ERROR_PROBLEMS
from hamipy.telemetry.service import ServiceTelemetry

__all__ = ["SERVICE_NAME", "Metrics", "Telemetry"]

SERVICE_NAME: Final = "hamipy-monitor"
# A scrape reads a few hundred small file ranges and asks NVML a few questions per GPU.
_SCRAPE_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The monitor's own counters on their own registry (the usage collector joins it later)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.scrape_seconds = Histogram(
            "hamipy_monitor_scrape_duration_seconds",
            "Time to render one /metrics answer (region files and NVML read included)",
            buckets=_SCRAPE_BUCKETS,
            registry=r,
        )
        self.region_errors = Counter(
            "hamipy_monitor_region_errors",
            "Region files found unreadable, by reason (counted when a file turns bad)",
            ["reason"],
            registry=r,
        )
        self.malformed = Counter(
            "hamipy_monitor_malformed_annotations",
            "Pod annotations the monitor could not decode (that pod's limits are not reported)",
            ["field"],
            registry=r,
        )
        self.dirs_removed = Counter(
            "hamipy_monitor_region_dirs_removed",
            "Region directories removed because their pod was gone longer than the grace period",
            registry=r,
        )
        self.cdi_specs_removed = Counter(
            "hamipy_monitor_cdi_specs_removed",
            "CDI spec files of slots removed because their pod was gone longer than the grace period",
            registry=r,
        )
        self.feedback_writes = Counter(
            "hamipy_monitor_feedback_writes",
            "Priority feedback writes into region files, by field",
            ["field"],
            registry=r,
        )
        self.nvml_errors = Counter(
            "hamipy_monitor_nvml_errors", "NVML calls that failed, by call", ["call"], registry=r
        )
        self.watch_restarts = Counter(
            "hamipy_monitor_watch_restarts",
            "Pod list+watch restarts, by cause (gone, error, closed)",
            ["cause"],
            registry=r,
        )
        # Known label values start at zero: a series that appears only at its first event hides
        # that event from rate() and increase() (a healthy node's "Region errors" showed no data).
        for reason in sorted(ERROR_PROBLEMS):
            self.region_errors.labels(reason=reason)
        for cause in ("gone", "error", "closed"):
            self.watch_restarts.labels(cause=cause)


class Telemetry(ServiceTelemetry[Metrics]):
    """Logger and metrics of one monitor (it makes no spans; the tracer is there as in every
    service)."""

    SERVICE = SERVICE_NAME
    TRACER_NAME = "hamipy.monitor"

    @classmethod
    def new_metrics(cls) -> Metrics:
        return Metrics()
