"""One running device plugin: discovery, the gRPC service, kubelet and node registration, GPU
health, this node's pods, and the HTTP endpoints (``/metrics``, ``/healthz``, ``/readyz``).

Every long-lived task runs under one ``hamipy.serving.supervision.Supervisor``, by name:

- ``device-plugin:serve``: the gRPC socket and the kubelet registration (``serving``);
- ``device-plugin:node-register``: the node's register and pair-score annotations and handshake
  (``node_registration``); the pair scores are computed once, at start (topology does not change
  while the plugin runs);
- ``device-plugin:pod-informer``: this node's pods (``pod_cache``, ``hamipy.kube.informer``);
- ``device-plugin:health-watch``: the NVML health watch, in a worker thread (``discovery``);
- ``device-plugin:health-record``: its findings into the inventory;
- ``device-plugin:events``: the Events about this node (``hamipy.kube.events``);
- ``device-plugin:mig-reconcile``: on a ``mig`` node, the dynamic MIG instances adopted at start
  and reconciled with this node's pods every few seconds (``mig_lifecycle``).

Each retries what is expected to fail (API errors, an absent kubelet). One that dies anyway (a bug,
or a forever-task that returned) is logged with its name and error, turns ``/readyz`` to 503 with
that reason, and ends ``run``, which returns the reason: the CLI exits with status 1 and the
DaemonSet restarts the plugin, rather than a plugin that still looks ready serving Allocate from a
pod view whose watch is dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Final, Protocol

from prometheus_client import generate_latest

from hamipy.device_plugin.allocating import ServeRules
from hamipy.device_plugin.allocator import Allocator
from hamipy.device_plugin.devices import MIG_SINGLE_UNSPLIT, MODE_MIG, Gpu, dynamic_mig_gpus, mig_findings
from hamipy.device_plugin.discovery import HealthWatch, discover_gpus, read_node_scores
from hamipy.device_plugin.errors import DevicePluginError, NvmlError
from hamipy.device_plugin.inventory import Inventory
from hamipy.device_plugin.kube import NodeKube, node_pods_informer
from hamipy.device_plugin.kubelet_pods import PodResourcesClient
from hamipy.device_plugin.mig_lifecycle import MigLifecycle
from hamipy.device_plugin.mig_manager import MigManager
from hamipy.device_plugin.node_registration import register_node_forever
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.servicer import DevicePluginServicer
from hamipy.device_plugin.serving import serve_and_register
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import SERVICE_NAME, Telemetry
from hamipy.kube.client import KubeApi
from hamipy.kube.events import EventRecorder
from hamipy.kube.informer import InformerSettings
from hamipy.protocol import ProtocolError
from hamipy.protocol.config import Config
from hamipy.protocol.node_scores import ASYMMETRIC_MESSAGE, ASYMMETRIC_REASON, NodeScores, encode_node_scores
from hamipy.serving.probes import start_probe_server
from hamipy.serving.supervision import Supervisor

__all__ = ["DevicePlugin", "HealthSource", "HealthWatchFactory", "ScoreReader", "install_interposer"]

_PRELOAD: Final = "ld.so.preload"
_LIBRARY: Final = "libvgpu.so"


def install_interposer(library: Path, hook_path: str) -> None:
    """Put ``libvgpu.so`` and the ``ld.so.preload`` naming it into the host's hook directory, which
    every Allocate mounts into containers (HAMi's device plugin image does the same at start)."""
    hook = Path(hook_path)
    (hook / "containers").mkdir(parents=True, exist_ok=True)
    staged = hook / f".{_LIBRARY}.new"
    shutil.copyfile(library, staged)
    staged.replace(hook / _LIBRARY)  # atomic: running containers keep the old inode
    (hook / _PRELOAD).write_text(f"{hook / _LIBRARY}\n")


class HealthSource(Protocol):
    """A blocking health watch (``discovery.HealthWatch``): ``run`` until ``stop``."""

    def run(self) -> None: ...

    def stop(self) -> None: ...


class HealthWatchFactory(Protocol):
    def __call__(
        self, uuids: list[str], on_unhealthy: Callable[[str, str], None], *, poll_s: float
    ) -> HealthSource: ...


class ScoreReader(Protocol):
    """Reads the pair scores of the GPUs ``uuids`` and the asymmetric pairs (blocking;
    ``discovery.read_node_scores``)."""

    def __call__(self, uuids: list[str]) -> tuple[NodeScores, list[tuple[str, str]]]: ...


async def _run_in_thread(source: HealthSource) -> None:
    """``source.run()`` in a worker thread; cancelled, it stops the source and waits for the thread."""
    done = asyncio.get_running_loop().run_in_executor(None, source.run)
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        source.stop()
        with contextlib.suppress(Exception):
            await done
        raise


class DevicePlugin:
    """Wiring of one plugin instance. ``discover``, ``health_watch``, ``read_scores`` and
    ``mig_manager`` reach NVML (tests hand in fakes); ``discover`` None reads the GPUs, with the
    allowed MIG profiles on a ``mig`` node."""

    def __init__(
        self,
        *,
        config: Config,
        settings: PluginSettings,
        telemetry: Telemetry,
        api: KubeApi,
        discover: Callable[[], list[Gpu]] | None = None,
        health_watch: HealthWatchFactory = HealthWatch,
        read_scores: ScoreReader = read_node_scores,
        mig_manager: MigManager | None = None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.telemetry = telemetry
        self.health_watch = health_watch
        self.read_scores = read_scores
        self.logger = telemetry.logger.bind(node=settings.node_name)
        self.kube = NodeKube(api, node_name=settings.node_name, timeout_s=settings.api_timeout_s)
        self.node_settings = config.for_node(settings.node_name)
        allowed = (
            self.node_settings.allowed_mig_profiles if self.node_settings.operating_mode == MODE_MIG else None
        )
        self.discover = discover if discover is not None else functools.partial(discover_gpus, allowed)
        self.mig_manager = mig_manager if mig_manager is not None else MigManager()
        self.mig: MigLifecycle | None = None
        self.supervisor = Supervisor(self.logger)
        self.events = EventRecorder(
            api, component=SERVICE_NAME, logger=self.logger, timeout_s=settings.api_timeout_s
        )
        self.pods = PodCache(
            node_pods_informer(
                api,
                settings.node_name,
                logger=self.logger,
                settings=InformerSettings(list_timeout_s=settings.api_timeout_s),
            )
        )
        self.registered = asyncio.Event()
        self.node_written = asyncio.Event()
        self.metrics_port: int | None = None
        self.inventory: Inventory | None = None

    async def run(self, stop: asyncio.Event) -> str | None:
        """Run until ``stop`` is set (None) or a supervised task dies (its failure, logged)."""
        return await self.supervisor.run(self.running(), stop)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Discover, serve HTTP and start the supervised tasks; on exit stop them all."""
        gpus = await asyncio.to_thread(self.discover)
        inventory = self.inventory = Inventory(gpus, self.node_settings)
        self.logger.info(
            "discovered GPUs",
            gpus=[(g.index, g.uuid, g.name, g.memory_mib, g.numa) for g in gpus],
            device_list_strategy=self.config.nvidia.device_list_strategy,
        )
        self._report_mig(gpus)
        inventory.scores = await self._pair_scores(inventory.uuids)
        dynamic = [gpu.uuid for gpu in dynamic_mig_gpus(gpus, self.node_settings)]
        mig = self.mig = (
            MigLifecycle(
                manager=self.mig_manager,
                api=self.kube,
                gpus=dynamic,
                telemetry=self.telemetry,
                events=self.events,
            )
            if dynamic
            else None
        )
        if mig is not None:  # adopt and reset before the kubelet can call Allocate (HAMi's order)
            async with mig.lock:
                await mig.sync()
        kubelet = PodResourcesClient(
            self.settings.pod_resources_socket,
            self.config.nvidia.resource_count_name,
            timeout_s=self.settings.grpc_timeout_s,
        )
        registered = inventory.register_devices()
        allocator = Allocator(
            api=self.kube,
            pods=self.pods,
            kubelet=kubelet.pods,
            nvidia=self.config.nvidia,
            node_settings=self.node_settings,
            telemetry=self.telemetry,
            rules=ServeRules(
                scheduler_name=self.config.scheduler_name,
                names=self.config.nvidia.resource_names,
                devmem={d.id: d.devmem for d in registered},
                mig_profiles={d.id: d.mig_profiles for d in registered if d.mig_profiles},
            ),
            device_ids=lambda: [d.id for d in inventory.kubelet_devices()],
            mig=mig,
        )
        servicer = DevicePluginServicer(inventory=inventory, allocator=allocator, telemetry=self.telemetry)
        loop = asyncio.get_running_loop()
        sick: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

        def unhealthy(uuid: str, reason: str) -> None:  # called from the health thread
            loop.call_soon_threadsafe(sick.put_nowait, (uuid, reason))

        async def record_health() -> None:
            while True:
                uuid, reason = await sick.get()
                if await inventory.mark_unhealthy(uuid, reason):
                    self.logger.warning("GPU unhealthy", device_uuid=uuid, reason=reason)

        server = await start_probe_server(
            host=self.settings.metrics_host,
            port=self.settings.metrics_port,
            render=functools.partial(asyncio.to_thread, generate_latest, self.telemetry.metrics.registry),
            not_ready=self.not_ready,
        )
        self.metrics_port = server.port
        health = self.health_watch(inventory.uuids, unhealthy, poll_s=self.settings.health_poll_s)
        start = self.supervisor.start
        try:
            start("device-plugin:events", self.events.run())
            start("device-plugin:pod-informer", self.pods.run())
            start("device-plugin:health-watch", _run_in_thread(health))
            start("device-plugin:health-record", record_health())
            if mig is not None:
                start("device-plugin:mig-reconcile", mig.run(self.settings.mig_reconcile_interval_s))
            start(
                "device-plugin:node-register",
                register_node_forever(
                    api=self.kube,
                    inventory=inventory,
                    settings=self.settings,
                    telemetry=self.telemetry,
                    written=self.node_written,
                ),
            )
            start(
                "device-plugin:serve",
                serve_and_register(
                    servicer=servicer,
                    settings=self.settings,
                    resource_name=self.config.nvidia.resource_count_name,
                    telemetry=self.telemetry,
                    registered=self.registered,
                ),
            )
            yield
        finally:
            await self.supervisor.stop()
            await kubelet.close()
            await server.close()
            self.logger.info("stopped", failure=self.supervisor.failure)

    def _report_mig(self, gpus: list[Gpu]) -> None:
        """Log and put on the node as Warning Events the GPUs MIG leaves out; a ``single`` node
        with a GPU that is not split is not served (``DevicePluginError``)."""
        findings = mig_findings(gpus, self.node_settings)
        refused = [f.message for f in findings if f.reason == MIG_SINGLE_UNSPLIT]
        if refused:
            raise DevicePluginError("; ".join(refused))
        node = {"kind": "Node", "name": self.settings.node_name, "uid": self.settings.node_name}
        for finding in findings:
            self.logger.warning(
                "GPU not registered",
                device_uuid=finding.gpu.uuid,
                reason=finding.reason,
                message=finding.message,
            )
            self.events.emit(node, finding.reason, finding.message, warning=True)

    async def _pair_scores(self, uuids: list[str]) -> str | None:
        """The ``hami.io/node-nvidia-score`` value of the registered GPUs; None (logged) where the
        topology cannot be read. An asymmetric pair is a Warning Event on the node (upstream's)."""
        try:
            scores, asymmetric = await asyncio.to_thread(self.read_scores, uuids)
        except (NvmlError, ProtocolError) as exc:
            self.logger.error("GPU pair scores not published: topology unreadable", error=str(exc))
            return None
        if asymmetric:
            self.logger.warning("asymmetric GPU P2P links scored 0", pairs=asymmetric)
            node = {"kind": "Node", "name": self.settings.node_name, "uid": self.settings.node_name}
            self.events.emit(node, ASYMMETRIC_REASON, ASYMMETRIC_MESSAGE, warning=True)
        return encode_node_scores(scores)

    def not_ready(self) -> str | None:
        """``/readyz``: None when ready, else why not (a dead task first)."""
        if self.supervisor.failure is not None:
            return self.supervisor.failure
        waiting = [
            what
            for done, what in (
                (self.registered.is_set(), "not registered with the kubelet"),
                (self.node_written.is_set(), "the node's register annotation not written"),
                (self.pods.synced.is_set(), "this node's pods not listed"),
            )
            if not done
        ]
        return "; ".join(waiting) or None
