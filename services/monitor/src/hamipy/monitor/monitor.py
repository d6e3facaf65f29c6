"""One running monitor: the pod watch, the scrape, the feedback and housekeeping pass, and the HTTP
endpoints (``/metrics``, ``/healthz``, ``/readyz``), under one TaskGroup.

``Monitor.run(stop)`` returns when ``stop`` is set; every background task is named, and one that
fails ends the monitor (the DaemonSet restarts it) after logging why. File reads and NVML calls
block, so the scrape and the housekeeping pass run in worker threads; they share the region files
under their lock and read the pod cache's immutable snapshot.

Housekeeping, every ``feedback_interval_s``: read every region, apply the priority feedback
(``feedback.py``) unless it is switched off, and remove the region directories of pods that have
been gone (while the pod view was fresh) for ``gone_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from hamipy.monitor.collector import ScrapeData, UsageCollector
from hamipy.monitor.errors import NvmlError
from hamipy.monitor.feedback import FeedbackInput, feedback
from hamipy.monitor.host_gpus import HostGpus, HostGpuSample
from hamipy.monitor.kube import PodsApi
from hamipy.monitor.pod_cache import PodCache
from hamipy.monitor.region_dirs import RegionReading
from hamipy.monitor.region_files import RegionFiles
from hamipy.monitor.settings import MonitorSettings
from hamipy.monitor.telemetry import Telemetry
from hamipy.monitor.usage import usage_report
from hamipy.telemetry.probes import ProbeServer, start_probe_server

__all__ = ["Monitor"]


class Monitor:
    """Wiring of one monitor instance. ``host_gpus`` None: no host GPU metrics."""

    def __init__(
        self,
        *,
        settings: MonitorSettings,
        telemetry: Telemetry,
        pods_api: PodsApi,
        host_gpus: HostGpus | None,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.host_gpus = host_gpus
        self.wall_clock = wall_clock
        self.monotonic = monotonic
        self.log = telemetry.log.bind(node=settings.node_name)
        self.pods = PodCache(
            pods_api,
            telemetry,
            watch_timeout_s=settings.watch_timeout_s,
            watch_inactivity_s=settings.watch_inactivity_s,
        )
        self.regions = RegionFiles(
            settings.hook_path,
            log=self.log,
            metrics=telemetry.metrics,
            max_entries_per_dir=settings.max_cache_files_per_dir,
        )
        telemetry.metrics.registry.register(
            UsageCollector(self.gather, node=settings.node_name, legacy=settings.legacy_metrics)
        )
        self.metrics_port: int | None = None
        self.housekeeping_passes = 0
        # Region directory -> when its pod was first found missing (monotonic seconds).
        self._missing_since: dict[Path, float] = {}

    # --- the scrape (worker thread) ---

    def gather(self) -> ScrapeData:
        """Read everything one scrape reports."""
        readings = self.regions.read_all()
        usage = usage_report(self.pods.snapshot, readings, now_s=self.wall_clock())
        host: list[HostGpuSample] | None = None
        if self.host_gpus is not None:
            with contextlib.suppress(NvmlError):  # logged and counted where it happened
                host = self.host_gpus.sample()
        return ScrapeData(usage=usage, readings=readings, host=host)

    def render(self) -> bytes:
        """The ``/metrics`` body."""
        with self.telemetry.metrics.scrape_seconds.time():
            return generate_latest(self.telemetry.metrics.registry)

    # --- housekeeping (worker thread) ---

    def housekeeping_once(self) -> None:
        """One feedback and clean-up pass."""
        readings = self.regions.read_all()
        if self.settings.feedback:
            self._feedback(readings)
        self._remove_gone(readings)
        self.housekeeping_passes += 1

    def _feedback(self, readings: list[RegionReading]) -> None:
        inputs = [
            FeedbackInput(
                key=r.file,
                priority=r.snapshot.priority,
                recent_kernel=r.snapshot.recent_kernel,
                utilization_switch=r.snapshot.utilization_switch,
                devices=r.snapshot.uuids,
            )
            for r in readings
            if r.file is not None and r.snapshot is not None
        ]
        for write in feedback(inputs):
            if self.regions.write_feedback(write.key, write.field, write.value):
                self.log.debug("feedback written", file=str(write.key), field=write.field, value=write.value)

    def _remove_gone(self, readings: list[RegionReading]) -> None:
        pods = self.pods.snapshot
        if not self.pods.fresh:
            return  # the view may miss pods that exist: remove nothing on it
        now = self.monotonic()
        present = set()
        for r in readings:
            path = r.dir.path
            present.add(path)
            if r.dir.pod_uid in pods:
                self._missing_since.pop(path, None)
                continue
            since = self._missing_since.setdefault(path, now)
            if now - since >= self.settings.gone_grace_s and self.regions.remove_dir(r.dir):
                del self._missing_since[path]
        for path in [p for p in self._missing_since if p not in present]:
            del self._missing_since[path]

    async def _housekeeping_forever(self) -> None:
        while True:
            await asyncio.to_thread(self.housekeeping_once)
            await asyncio.sleep(self.settings.feedback_interval_s)

    # --- running ---

    async def run(self, stop: asyncio.Event) -> None:
        self.log.info(
            "starting",
            hook_path=str(self.settings.hook_path),
            feedback=self.settings.feedback,
            legacy_metrics=self.settings.legacy_metrics,
        )
        runner = await self._start_http()
        try:
            async with asyncio.TaskGroup() as group:
                watch = group.create_task(
                    self._supervised("monitor:pod-watch", self.pods.run()), name="monitor:pod-watch"
                )
                housekeeping = group.create_task(
                    self._supervised("monitor:housekeeping", self._housekeeping_forever()),
                    name="monitor:housekeeping",
                )
                await stop.wait()
                watch.cancel()
                housekeeping.cancel()
        finally:
            await runner.close()
            await asyncio.to_thread(self._close)
            self.log.info("stopped")

    async def _supervised(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background task; log why it failed before the failure ends the monitor."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("background task failed; stopping", task=name)
            raise

    def _close(self) -> None:
        self.regions.close()
        if self.host_gpus is not None:
            self.host_gpus.close()

    async def _start_http(self) -> ProbeServer:
        server = await start_probe_server(
            host=self.settings.metrics_host,
            port=self.settings.metrics_port,
            render=self.render,
            not_ready=lambda: None if self.pods.synced.is_set() else "this node's pods are not listed yet",
        )
        self.metrics_port = server.port
        return server
