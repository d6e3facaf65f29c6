"""One running device plugin: discovery, the gRPC service, kubelet and node registration, GPU
health, and the HTTP endpoints (``/metrics``, ``/healthz``, ``/readyz``), under one TaskGroup.

``DevicePlugin.run(stop)`` returns when ``stop`` is set; every background task is named, and one
that fails ends the plugin (the DaemonSet restarts it) after logging why.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any, Final

from prometheus_client import generate_latest

from hamipy.device_plugin.allocator import Allocator
from hamipy.device_plugin.discovery import Gpu, HealthWatch, Nvml
from hamipy.device_plugin.inventory import Inventory
from hamipy.device_plugin.kube import NodeApi
from hamipy.device_plugin.node_registration import register_node_forever
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.servicer import DevicePluginServicer
from hamipy.device_plugin.serving import serve_and_register
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.protocol.config import Config
from hamipy.telemetry.probes import ProbeServer, start_probe_server

__all__ = ["DevicePlugin", "install_interposer"]

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


class DevicePlugin:
    """Wiring of one plugin instance."""

    def __init__(
        self, *, config: Config, settings: PluginSettings, telemetry: Telemetry, api_client: Any
    ) -> None:
        self.config = config
        self.settings = settings
        self.telemetry = telemetry
        self.api = NodeApi(api_client, node_name=settings.node_name, timeout_s=settings.api_timeout_s)
        self.node_settings = config.for_node(settings.node_name)
        self.registered = asyncio.Event()
        self.node_written = asyncio.Event()
        self.metrics_port: int | None = None
        self.inventory: Inventory | None = None
        self.pods: PodCache | None = None

    async def run(self, stop: asyncio.Event) -> None:
        gpus: list[Gpu] = await asyncio.to_thread(self._discover)
        inventory = self.inventory = Inventory(gpus, self.node_settings)
        log = self.telemetry.log.bind(node=self.settings.node_name)
        log.info("discovered GPUs", gpus=[(g.index, g.uuid, g.name, g.memory_mib, g.numa) for g in gpus])
        pods = self.pods = PodCache(self.api, self.telemetry)
        allocator = Allocator(
            api=self.api,
            pods=pods,
            nvidia=self.config.nvidia,
            node_settings=self.node_settings,
            telemetry=self.telemetry,
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
                    log.warning("GPU unhealthy", device_uuid=uuid, reason=reason)

        health = HealthWatch(inventory.uuids, unhealthy, poll_s=self.settings.health_poll_s)
        runner = await self._start_http()
        health.start()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(
                    serve_and_register(
                        servicer=servicer,
                        settings=self.settings,
                        resource_name=self.config.nvidia.resource_count_name,
                        telemetry=self.telemetry,
                        stop=stop,
                        registered=self.registered,
                    ),
                    name="device-plugin:serve",
                )
                register = group.create_task(
                    register_node_forever(
                        api=self.api,
                        inventory=inventory,
                        settings=self.settings,
                        telemetry=self.telemetry,
                        written=self.node_written,
                    ),
                    name="device-plugin:node-register",
                )
                health_task = group.create_task(record_health(), name="device-plugin:health")
                watch = group.create_task(pods.run(), name="device-plugin:pod-watch")
                await stop.wait()
                for task in (register, health_task, watch):
                    task.cancel()
        finally:
            await asyncio.to_thread(health.stop)
            await runner.close()
            log.info("stopped")

    def _discover(self) -> list[Gpu]:
        with Nvml() as nvml:
            return nvml.gpus()

    def _not_ready(self) -> str | None:
        synced = self.pods is not None and self.pods.synced.is_set()
        if synced and self.registered.is_set() and self.node_written.is_set():
            return None
        return "not registered with the kubelet and the node, or pods not listed"

    async def _start_http(self) -> ProbeServer:
        server = await start_probe_server(
            host=self.settings.metrics_host,
            port=self.settings.metrics_port,
            render=lambda: generate_latest(self.telemetry.metrics.registry),
            not_ready=self._not_ready,
        )
        self.metrics_port = server.port
        return server
