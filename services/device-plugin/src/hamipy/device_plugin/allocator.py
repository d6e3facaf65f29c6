"""Allocate: the env and mounts of each container the kubelet asks about
(docs/wire-format.md#allocate-response).

For each ``ContainerAllocateRequest`` the pod and container are found (``allocating.choose``)
among this node's pods as the watch-fed ``PodCache`` has them (a fresh list when no pod there
fits), the response is built with ``hamipy.protocol.allocation_env``, the host directory for the
container's region file is created, and the pod's ``vgpu-devices-to-allocate`` slot is emptied. A
fully served pod gets ``bind-phase=success`` and its node lock is released; on any error the pod
gets ``bind-phase=failed``, its lock is released and the kubelet is told why. Allocates on one
node are serialised: each sees what the previous one wrote.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace

from hamipy.device_plugin.allocating import PHASE_FAILED, PHASE_SUCCESS, Served, choose
from hamipy.device_plugin.errors import AllocateError, DevicePluginError
from hamipy.device_plugin.kube import NodeKube
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.errors import KubeError
from hamipy.protocol import ProtocolError, keys
from hamipy.protocol.allocation_env import ContainerAllocation, container_allocation, region_host_dir
from hamipy.protocol.config import NodeSettings, NvidiaConfig
from hamipy.telemetry import pod_trace_context

__all__ = ["Allocator"]


def _make_region_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o777)  # the container's processes need not be root to create their region file


class Allocator:
    """Serves Allocate requests for one node."""

    def __init__(
        self,
        *,
        api: NodeKube,
        pods: PodCache,
        nvidia: NvidiaConfig,
        node_settings: NodeSettings,
        telemetry: Telemetry,
        cache_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.api = api
        self.pods = pods
        self.nvidia = nvidia
        self.node_settings = node_settings
        self.telemetry = telemetry
        self.cache_id = cache_id
        self._serial = asyncio.Lock()

    async def allocate(self, device_counts: Sequence[int]) -> list[ContainerAllocation]:
        """One Allocate call: a ``ContainerAllocation`` per requested container, in order."""
        started = time.perf_counter()
        result = "failed"
        try:
            async with self._serial:
                allocations = await self._allocate(device_counts)
            result = "success"
            return allocations
        finally:
            self.telemetry.metrics.allocate_seconds.labels(result=result).observe(
                time.perf_counter() - started
            )

    async def _allocate(self, device_counts: Sequence[int]) -> list[ContainerAllocation]:
        allocations = []
        listed = False
        node, order = self.api.node_name, self.pods.bind_order
        for count in device_counts:
            choice = choose(self.pods.pods(), node=node, device_count=count, bind_order=order)
            if choice.served is None and not listed:
                # The watch may not have delivered the pod yet: read the node's pods afresh once.
                items, _ = await self.api.node_pods()
                self.pods.merge(items)
                listed = True
                choice = choose(self.pods.pods(), node=node, device_count=count, bind_order=order)
            for pod, reason in choice.broken:
                meta = pod.get("metadata") or {}
                await self._fail(meta, f"malformed allocation: {reason}")
            if choice.served is None:
                self._count("failed", "NoPendingPod")
                raise AllocateError(
                    f"no pod on node {self.api.node_name} is waiting for a container of {count} device(s) "
                    f"(bind-phase={keys.BIND_PHASE} allocating)"
                )
            served = choice.served
            pod = next(p for p in self.pods.pods() if (p.get("metadata") or {}).get("uid") == served.uid)
            try:
                allocations.append(await self._serve(pod, served))
            except (DevicePluginError, KubeError, ProtocolError, OSError) as exc:
                await self._fail(pod.get("metadata") or {}, str(exc))
                raise AllocateError(f"pod {served.namespace}/{served.name}: {exc}") from exc
        return allocations

    async def _serve(self, pod: Mapping[str, Any], served: Served) -> ContainerAllocation:
        log = self.telemetry.logger.bind(
            namespace=served.namespace, pod=served.name, uid=served.uid, container=served.container
        )
        with self.telemetry.tracer.start_as_current_span(
            "device_plugin.allocate", context=pod_trace_context(pod)
        ) as span:
            span.set_attribute("k8s.pod.name", served.name)
            span.set_attribute("k8s.namespace.name", served.namespace)
            span.set_attribute("k8s.pod.uid", served.uid)
            span.set_attribute("k8s.container.name", served.container)
            span.set_attribute("hamipy.devices", ",".join(d.uuid for d in served.devices))
            try:
                allocation = container_allocation(
                    served.devices,
                    pod_uid=served.uid,
                    container_name=served.container,
                    container_env=served.container_env,
                    cache_id=self.cache_id(),
                    hook_path=self.nvidia.hook_path,
                    memory_scaling=self.node_settings.device_memory_scaling,
                    core_policy=self.nvidia.gpu_core_policy,
                    disable_core_limit=self.node_settings.disable_core_limit,
                    log_level=self.node_settings.lib_cuda_log_level,
                )
                region_dir = Path(region_host_dir(self.nvidia.hook_path, served.uid, served.container))
                await asyncio.to_thread(_make_region_dir, region_dir)
                annotations = {keys.DEVICES_TO_ALLOCATE: served.to_allocate}
                if served.done:
                    annotations[keys.BIND_PHASE] = PHASE_SUCCESS
                written = await self.api.patch_pod_annotations(
                    served.namespace, served.name, served.uid, annotations
                )
                self.pods.remember(written)  # the next Allocate sees this container served
                if served.done:
                    await self._release_lock(served.namespace, served.name)
            except Exception as exc:
                span.set_status(trace.StatusCode.ERROR, str(exc))
                log.error("allocate failed", error=str(exc))
                self._count("failed", type(exc).__name__)
                raise
            log.info(  # inside the span: the line carries its trace and span ids
                "allocated",
                slot=served.slot,
                devices=[d.uuid for d in served.devices],
                pod_done=served.done,
            )
        self._count("success", "Allocated")
        return allocation

    async def _fail(self, meta: Mapping[str, Any], reason: str) -> None:
        """Best effort: ``bind-phase=failed`` on the pod and its lock released; logged either way."""
        namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid"))
        self.telemetry.logger.error(
            "pod allocation failed", namespace=namespace, pod=name, uid=uid, reason=reason
        )
        try:
            written = await self.api.patch_pod_annotations(
                namespace, name, uid, {keys.BIND_PHASE: PHASE_FAILED}
            )
            self.pods.remember(written)
            await self._release_lock(namespace, name)
        except KubeError as exc:
            self.telemetry.logger.error(
                "could not mark pod failed", namespace=namespace, pod=name, error=str(exc)
            )

    async def _release_lock(self, namespace: str, name: str) -> None:
        """Remove the node lock if this pod holds it (never another pod's: ``hamipy.kube.node_lock``)."""
        released = await self.api.release_node_lock(namespace, name)
        if released == "released":
            self.telemetry.logger.info("node lock released", namespace=namespace, pod=name)
        elif released == "contended":
            self.telemetry.logger.warning(
                "node lock not released: every write lost a race; it expires", namespace=namespace, pod=name
            )

    def _count(self, result: str, reason: str) -> None:
        self.telemetry.metrics.allocations.labels(result=result, reason=reason).inc()
