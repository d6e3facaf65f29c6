"""One running monitor: the pod watch, the scrape, the feedback and housekeeping pass, and the HTTP
endpoints (``/metrics``, ``/healthz``, ``/readyz``).

The long-lived tasks run under one ``hamipy.serving.supervision.Supervisor``, by name:
``monitor:pod-informer`` (this node's pods, ``pod_cache``) and ``monitor:housekeeping``. One that
dies (a bug: API errors are retried inside the informer) is logged with its name and error, turns
``/readyz`` to 503 with that reason, and ends ``Monitor.run``, which returns the reason: the CLI
exits with status 1 and the DaemonSet restarts the monitor, rather than one that still looks ready
reporting from a pod view whose watch is dead. ``run`` returns None when ``stop`` is set.

File reads and NVML calls block, so the scrape and the housekeeping pass run in worker threads;
they share the region files under their lock and read the pod cache's immutable snapshot.

Housekeeping, every ``feedback_interval_s``: read every region, apply the priority feedback
(``feedback.py``) unless it is switched off, and remove the region directories, and the CDI spec
files (``cdi_specs``, under the ``cdi-cri`` strategy), of pods that have been gone (while the pod
view was fresh) for ``gone_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from prometheus_client import generate_latest

from hamipy.kube.client import KubeApi
from hamipy.kube.informer import InformerSettings
from hamipy.monitor.cdi_specs import CdiSpecs
from hamipy.monitor.collector import ScrapeData, UsageCollector
from hamipy.monitor.errors import NvmlError
from hamipy.monitor.feedback import FeedbackInput, feedback
from hamipy.monitor.gpu_samples import HostGpuSample
from hamipy.monitor.host_gpus import HostGpus
from hamipy.monitor.mig_info import mig_info_rows
from hamipy.monitor.pod_cache import PodCache
from hamipy.monitor.region_dirs import RegionReading
from hamipy.monitor.region_files import RegionFiles
from hamipy.monitor.settings import MonitorSettings
from hamipy.monitor.telemetry import Telemetry
from hamipy.monitor.usage import usage_report
from hamipy.serving.probes import start_probe_server
from hamipy.serving.supervision import Supervisor

__all__ = ["Monitor"]


class Monitor:
    """Wiring of one monitor instance. ``host_gpus`` None: no host GPU metrics."""

    def __init__(
        self,
        *,
        settings: MonitorSettings,
        telemetry: Telemetry,
        api: KubeApi,
        host_gpus: HostGpus | None,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.host_gpus = host_gpus
        self.wall_clock = wall_clock
        self.monotonic = monotonic
        self.logger = telemetry.logger.bind(node=settings.node_name)
        self.supervisor = Supervisor(self.logger)
        self.pods = PodCache(
            api,
            telemetry,
            node_name=settings.node_name,
            settings=InformerSettings(
                list_timeout_s=settings.api_timeout_s,
                watch_timeout_s=settings.watch_timeout_s,
                inactivity_s=settings.watch_inactivity_s,
            ),
        )
        self.regions = RegionFiles(
            settings.hook_path,
            logger=self.logger,
            metrics=telemetry.metrics,
            max_entries_per_dir=settings.max_cache_files_per_dir,
        )
        self.cdi_specs = (
            None
            if settings.cdi_spec_dir is None
            else CdiSpecs(settings.cdi_spec_dir, logger=self.logger, metrics=telemetry.metrics)
        )
        telemetry.metrics.registry.register(
            UsageCollector(self.gather, node=settings.node_name, legacy=settings.legacy_metrics)
        )
        self.metrics_port: int | None = None
        self.housekeeping_passes = 0
        # Region directory or CDI spec file -> when its pod was first found missing (monotonic seconds).
        self._missing_since: dict[Path, float] = {}

    # --- the scrape (worker thread) ---

    def gather(self) -> ScrapeData:
        """Read everything one scrape reports."""
        readings = self.regions.read_all()
        pods = self.pods.snapshot
        usage = usage_report(pods, readings, now_s=self.wall_clock())
        host: list[HostGpuSample] | None = None
        if self.host_gpus is not None:
            with contextlib.suppress(NvmlError):  # logged and counted where it happened
                host = self.host_gpus.sample()
        return ScrapeData(usage=usage, readings=readings, host=host, mig=mig_info_rows(pods, host))

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
                self.logger.debug(
                    "feedback written", file=str(write.key), field=write.field, value=write.value
                )

    def _remove_gone(self, readings: list[RegionReading]) -> None:
        pods = self.pods.snapshot
        if not self.pods.fresh:
            return  # the view may miss pods that exist: remove nothing on it
        # What the node keeps for a container: (its pod's uid, the path, how to remove it).
        leftovers: list[tuple[str, Path, Callable[[], bool]]] = [
            (r.dir.pod_uid, r.dir.path, functools.partial(self.regions.remove_dir, r.dir)) for r in readings
        ]
        if self.cdi_specs is not None:
            specs = self.cdi_specs
            leftovers += [(s.pod_uid, s.path, functools.partial(specs.remove, s)) for s in specs.list()]
        now = self.monotonic()
        present = set()
        for pod_uid, path, remove in leftovers:
            present.add(path)
            if pod_uid in pods:
                self._missing_since.pop(path, None)
                continue
            since = self._missing_since.setdefault(path, now)
            if now - since >= self.settings.gone_grace_s and remove():
                del self._missing_since[path]
        for path in [p for p in self._missing_since if p not in present]:
            del self._missing_since[path]

    async def _housekeeping_forever(self) -> None:
        while True:
            await asyncio.to_thread(self.housekeeping_once)
            await asyncio.sleep(self.settings.feedback_interval_s)

    # --- running ---

    async def run(self, stop: asyncio.Event) -> str | None:
        """Run until ``stop`` is set (None) or a supervised task dies (its failure, logged)."""
        return await self.supervisor.run(self.running(), stop)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Serve HTTP and start the supervised tasks; on exit stop them, then the files and NVML."""
        self.logger.info(
            "starting",
            hook_path=str(self.settings.hook_path),
            feedback=self.settings.feedback,
            legacy_metrics=self.settings.legacy_metrics,
        )
        server = await start_probe_server(
            host=self.settings.metrics_host,
            port=self.settings.metrics_port,
            render=functools.partial(asyncio.to_thread, self.render),  # it reads files
            not_ready=self.not_ready,
        )
        self.metrics_port = server.port
        try:
            self.supervisor.start("monitor:pod-informer", self.pods.run())
            self.supervisor.start("monitor:housekeeping", self._housekeeping_forever())
            yield
        finally:
            await self.supervisor.stop()
            await server.close()
            await asyncio.to_thread(self._close)
            self.logger.info("stopped", failure=self.supervisor.failure)

    def not_ready(self) -> str | None:
        """``/readyz``: None when ready, else why not (a dead task first)."""
        if self.supervisor.failure is not None:
            return self.supervisor.failure
        return None if self.pods.synced.is_set() else "this node's pods are not listed yet"

    def _close(self) -> None:
        self.regions.close()
        if self.host_gpus is not None:
            self.host_gpus.close()
