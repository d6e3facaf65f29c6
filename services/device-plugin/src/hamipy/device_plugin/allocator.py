"""Allocate: the env and mounts of each container the kubelet asks about
(docs/wire-format.md#allocate-response), and GetPreferredAllocation: the device IDs it should ask
with.

For each ``ContainerAllocateRequest`` the pod and container are found (``allocating.choose``)
among this node's pods as the watch-fed ``PodCache`` has them (a fresh list when no pod there
fits), restricted to what the kubelet's PodResources API says it is admitting
(``kubelet_pods``). The request's device IDs must be this plugin's and lie on exactly the GPUs the
scheduler planned for that container; then the response is built with
``hamipy.protocol.allocation_env``, the host directory for the container's region file is created
with the container's limits file in it (written before the answer, read-only to the container),
and the pod's ``vgpu-devices-to-allocate`` slot is emptied. The answer is that env and those mounts
(``nvidia.deviceListStrategy: envvar``), or (``cdi-cri``) the CDI names of the slot and its GPUs,
the slot's spec file, holding the same env and mounts, written first (``cdi_specs``). A fully
served pod gets ``bind-phase=success`` and its node lock is released; on any error the pod gets
``bind-phase=failed``, its lock is released and the kubelet is told why (an ID that is not ours
fails no pod: no pod is looked at). A waiting pod that breaks a serving rule but is not in line is
logged once per reason and left alone.

When the kubelet could be admitting more than one waiting pod, or its PodResources API does not
answer, nobody is served and no pod is marked: the kubelet fails the admission it was making, with
the reason. ``preferred`` picks the pod the same way, without writing anything, and answers one ID
on each planned GPU (``devices.preferred_ids``), or nothing: the kubelet then chooses itself.
Allocates on one node are serialised, and preferences with them: each sees what the previous one
wrote.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from opentelemetry import trace

from hamipy.device_plugin.allocating import (
    PHASE_FAILED,
    PHASE_SUCCESS,
    Choice,
    KubeletPods,
    Served,
    ServeRules,
    choose,
    pod_key,
)
from hamipy.device_plugin.cdi_specs import write_slot_spec
from hamipy.device_plugin.devices import gpu_of, preferred_ids
from hamipy.device_plugin.errors import AllocateError, DevicePluginError, KubeletUnreachable, UnknownDevice
from hamipy.device_plugin.kube import NodeKube
from hamipy.device_plugin.mig_lifecycle import MigLifecycle
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.errors import KubeError
from hamipy.protocol import ContainerDevice, ProtocolError, keys
from hamipy.protocol.allocation_env import ContainerAllocation, Mount, container_allocation
from hamipy.protocol.cdi import slot_cdi_devices
from hamipy.protocol.config import NodeSettings, NvidiaConfig
from hamipy.telemetry import pod_trace_context

__all__ = ["Allocator", "Answer", "Preference"]

_NAMED_IDS = 20
"""Unknown device IDs an Allocate's refusal names; the rest are counted."""


class Preference(NamedTuple):
    """One ``ContainerPreferredAllocationRequest``."""

    available: Sequence[str]
    must_include: Sequence[str]
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """One ``ContainerAllocateResponse``: env and mounts (``envvar``), or CDI device names
    (``cdi-cri``: the slot's, then its GPUs')."""

    envs: Mapping[str, str]
    mounts: tuple[Mount, ...]
    cdi_devices: tuple[str, ...]
    limits_path: str
    """Where the container's limits file was written (either strategy)."""


def _with_to_allocate(pod: Mapping[str, Any], value: str) -> dict[str, Any]:
    """A copy of ``pod`` whose ``vgpu-devices-to-allocate`` is ``value``."""
    meta = dict(pod.get("metadata") or {})
    meta["annotations"] = {**(meta.get("annotations") or {}), keys.DEVICES_TO_ALLOCATE: value}
    return {**pod, "metadata": meta}


def _write_limits(allocation: ContainerAllocation) -> None:
    """The container's region directory, and its limits file in it, written whole (a new inode:
    a container already running keeps the file it was started with)."""
    path = Path(allocation.limits_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o777)  # the container's processes need not be root to create their region file
    staged = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    staged.write_text(allocation.limits_text)
    os.chmod(staged, 0o444)
    staged.replace(path)


class Allocator:
    """Serves Allocate requests for one node."""

    def __init__(
        self,
        *,
        api: NodeKube,
        pods: PodCache,
        kubelet: Callable[[], Awaitable[KubeletPods]],
        nvidia: NvidiaConfig,
        node_settings: NodeSettings,
        telemetry: Telemetry,
        rules: ServeRules | None = None,
        device_ids: Callable[[], Collection[str]] | None = None,
        cache_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        mig: MigLifecycle | None = None,
    ) -> None:
        """``kubelet``: the kubelet's active pods now (``PodResourcesClient.pods``); ``rules``: who
        may be served (default: ``hami-scheduler`` and ``nvidia``'s resource names); ``device_ids``:
        the IDs this plugin advertises, the only ones an Allocate may name (None: not checked; the
        plugin always passes its inventory's); ``mig``: the dynamic MIG GPUs' lifecycle (a ``mig``
        node)."""
        self.api = api
        self.pods = pods
        self.kubelet = kubelet
        self.nvidia = nvidia
        self.node_settings = node_settings
        self.telemetry = telemetry
        self.rules = rules if rules is not None else ServeRules(names=nvidia.resource_names)
        self.device_ids = device_ids
        self.cache_id = cache_id
        self.mig = mig
        self._serial = asyncio.Lock()
        self._reported: dict[str, str] = {}
        """Skipped pods already logged: uid -> the reason logged."""

    async def allocate(self, requests: Sequence[Sequence[str]]) -> list[Answer]:
        """One Allocate call (each request: one container's device IDs): an ``Answer`` per
        container, in order. Raises ``UnknownDevice`` or ``AllocateError``."""
        started = time.perf_counter()
        result = "failed"
        try:
            async with self._serial:
                allocations = await self._allocate(requests)
            result = "success"
            return allocations
        finally:
            self.telemetry.metrics.allocate_seconds.labels(result=result).observe(
                time.perf_counter() - started
            )

    async def preferred(self, requests: Sequence[Preference]) -> list[list[str]]:
        """Per request, one available ID on each GPU planned for the container in line, or [] when
        no pod is (nothing is written; an API error is logged and answers [])."""
        async with self._serial:
            answers: list[list[str]] = []
            pending: dict[str, str] = {}  # uid -> its to-allocate once the requests before are served
            listed = False
            for request in requests:
                try:
                    choice, listed = await self._choose(request.size, listed, pending)
                except (KubeError, KubeletUnreachable) as exc:
                    self.telemetry.logger.warning("no preferred allocation: pods not known", error=str(exc))
                    answers.append([])
                    continue
                served = choice.served
                if served is None:
                    answers.append([])
                    continue
                pending[served.uid] = served.to_allocate
                ids = preferred_ids([d.uuid for d in served.devices], request.available, request.must_include)
                self.telemetry.logger.info(
                    "preferred allocation",
                    namespace=served.namespace,
                    pod=served.name,
                    uid=served.uid,
                    container=served.container,
                    devices=ids,
                )
                answers.append(ids)
            return answers

    def _unknown(self, requests: Sequence[Sequence[str]]) -> list[str]:
        if self.device_ids is None:
            return []
        known = set(self.device_ids())
        return [device for request in requests for device in request if device not in known]

    def _candidates(self, pending: Mapping[str, str]) -> list[dict[str, Any]]:
        """The node's pods, with ``pending`` (uid -> to-allocate) applied."""
        pods = self.pods.pods()
        if not pending:
            return pods
        out = []
        for pod in pods:
            uid = str((pod.get("metadata") or {}).get("uid"))
            out.append(_with_to_allocate(pod, pending[uid]) if uid in pending else pod)
        return out

    async def _choose(self, count: int, listed: bool, pending: Mapping[str, str]) -> tuple[Choice, bool]:
        """The choice for ``count`` devices among the pods the kubelet holds now, after one fresh
        read of the node's pods when the cache has nobody, or more than one pod, in line (the watch
        may not have delivered the pod the kubelet is admitting yet, or another's Failed status);
        and whether read. Raises ``KubeletUnreachable``."""
        kubelet = await self.kubelet()
        node = self.api.node_name
        choice = choose(
            self._candidates(pending), node=node, device_count=count, kubelet=kubelet, rules=self.rules
        )
        # Nobody in line, or more than one (a pod the kubelet rejected whose Failed status has not
        # reached the cache, where the kubelet still lists terminal pods): read the pods afresh once.
        if choice.served is None and choice.refused is None and not listed:
            items, _ = await self.api.node_pods()
            self.pods.merge(items)
            listed = True
            choice = choose(
                self._candidates(pending), node=node, device_count=count, kubelet=kubelet, rules=self.rules
            )
        self._report_skipped(choice.skipped)
        return choice, listed

    def _report_skipped(self, skipped: Sequence[tuple[Mapping[str, Any], str]]) -> None:
        """Log each skipped pod once per reason (it stays waiting, and every Allocate meets it)."""
        for pod, reason in skipped:
            meta = pod.get("metadata") or {}
            uid = str(meta.get("uid"))
            if self._reported.get(uid) != reason:
                self._reported[uid] = reason
                self.telemetry.logger.warning(
                    "waiting pod not served: it breaks a serving rule",
                    namespace=meta.get("namespace"),
                    pod=meta.get("name"),
                    uid=uid,
                    reason=reason,
                )
        if self._reported:  # forget pods that are gone
            live = {str((p.get("metadata") or {}).get("uid")) for p in self.pods.pods()}
            self._reported = {uid: why for uid, why in self._reported.items() if uid in live}

    async def _allocate(self, requests: Sequence[Sequence[str]]) -> list[Answer]:
        unknown = self._unknown(requests)
        if unknown:
            self._count("failed", "UnknownDevice")
            self.telemetry.logger.error("allocate names unknown device IDs", devices=unknown)
            # The reason travels in gRPC metadata (8 KiB by default): name a few, count the rest.
            named = ", ".join(unknown[:_NAMED_IDS])
            more = f" and {len(unknown) - _NAMED_IDS} more" if len(unknown) > _NAMED_IDS else ""
            raise UnknownDevice(
                f"device IDs [{named}]{more} are not devices of the {self.nvidia.resource_count_name} "
                f"plugin on node {self.api.node_name}"
            )
        allocations = []
        listed = False
        for ids in requests:
            try:
                choice, listed = await self._choose(len(ids), listed, {})
            except KubeletUnreachable:
                self._count("failed", "KubeletUnreachable")
                raise
            for pod, reason in choice.broken:
                await self._fail(pod.get("metadata") or {}, f"malformed allocation: {reason}")
            if choice.ambiguous:
                names = ["/".join(pod_key(p)) for p in choice.ambiguous]
                self._count("failed", "Ambiguous")
                self.telemetry.logger.error("allocate matches more than one waiting pod", pods=names)
                raise AllocateError(
                    f"the kubelet could be admitting any of {names} for {len(ids)} device(s) on node "
                    f"{self.api.node_name}: none is served rather than one given another's slot"
                )
            if choice.refused is not None:
                pod, reason = choice.refused
                meta = pod.get("metadata") or {}
                await self._fail(meta, f"not served: {reason}")
                self._count("failed", "NotServable")
                raise AllocateError(f"pod {meta.get('namespace')}/{meta.get('name')} is not served: {reason}")
            if choice.served is None:
                self._count("failed", "NoPendingPod")
                raise AllocateError(
                    f"no pod the kubelet is admitting on node {self.api.node_name} waits for a container "
                    f"of {len(ids)} device(s) ({keys.BIND_PHASE}=allocating, placed by "
                    f"{self.rules.scheduler_name})"
                )
            served = choice.served
            pod = next(p for p in self.pods.pods() if (p.get("metadata") or {}).get("uid") == served.uid)
            planned = [d.uuid for d in served.devices]
            if {gpu_of(device) for device in ids} != set(planned):
                reason = (
                    f"device IDs {list(ids)} are not on the GPUs planned for container "
                    f"{served.container}: {planned}"
                )
                await self._fail(pod.get("metadata") or {}, reason)
                self._count("failed", "WrongDevices")
                raise AllocateError(f"pod {served.namespace}/{served.name}: {reason}")
            try:
                allocations.append(await self._serve(pod, served))
            except (DevicePluginError, KubeError, ProtocolError, OSError) as exc:
                await self._fail(pod.get("metadata") or {}, str(exc))
                raise AllocateError(f"pod {served.namespace}/{served.name}: {exc}") from exc
        return allocations

    async def _serve(self, pod: Mapping[str, Any], served: Served) -> Answer:
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
                answer, devices = await self._make(pod, served)
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
                mig_devices=[d.uuid for d in devices if d not in served.devices],
                cdi_devices=list(answer.cdi_devices),
                pod_done=served.done,
            )
        self._count("success", "Allocated")
        return answer

    async def _make(self, pod: Mapping[str, Any], served: Served) -> tuple[Answer, list[ContainerDevice]]:
        """The container's limits file and answer, and the pod's slot emptied; on a dynamic MIG GPU
        its instances made first (under the MIG lock, after a reconcile) and recorded in the same
        write, or destroyed again when a step fails."""
        mig = self.mig if self.mig is not None and self.mig.serves(served.devices) else None
        if mig is None:
            return await self._write(served, served.devices, {}), served.devices
        async with mig.lock:
            await mig.sync()
            realised = await mig.realise(pod, slot=served.slot, devices=served.devices)
            try:
                answer = await self._write(
                    served, realised.devices, {keys.MIG_ALLOCATIONS: realised.annotation}, memory_scaling=1.0
                )
            except BaseException:
                await mig.rollback(realised.made)
                raise
            return answer, realised.devices

    async def _write(
        self,
        served: Served,
        devices: Sequence[ContainerDevice],
        annotations: Mapping[str, str],
        *,
        memory_scaling: float | None = None,
    ) -> Answer:
        """Limits file, answer, and the pod's slot emptied with ``annotations``."""
        allocation = container_allocation(
            devices,
            pod_uid=served.uid,
            container_name=served.container,
            cache_id=self.cache_id(),
            hook_path=self.nvidia.hook_path,
            memory_scaling=self.node_settings.device_memory_scaling
            if memory_scaling is None
            else memory_scaling,
            core_policy=self.nvidia.gpu_core_policy,
            disable_core_limit=self.node_settings.disable_core_limit,
            log_level=self.node_settings.lib_cuda_log_level,
            task_priority=served.priority,
        )
        await asyncio.to_thread(_write_limits, allocation)
        answer = await self._answer(allocation, served, [d.uuid for d in devices])
        written_annotations = {**annotations, keys.DEVICES_TO_ALLOCATE: served.to_allocate}
        if served.done:
            written_annotations[keys.BIND_PHASE] = PHASE_SUCCESS
        written = await self.api.patch_pod_annotations(
            served.namespace, served.name, served.uid, written_annotations
        )
        self.pods.remember(written)  # the next Allocate sees this container served
        return answer

    async def _answer(self, allocation: ContainerAllocation, served: Served, uuids: list[str]) -> Answer:
        """The answer in the configured strategy; for ``cdi-cri`` the slot's spec written first."""
        if self.nvidia.device_list_strategy == "envvar":
            return Answer(allocation.envs, allocation.mounts, (), allocation.limits_path)
        devices = slot_cdi_devices(served.uid, served.container, uuids)
        await asyncio.to_thread(
            write_slot_spec,
            Path(self.nvidia.cdi_spec_dir),
            allocation,
            pod_uid=served.uid,
            container=served.container,
        )
        return Answer({}, (), devices, allocation.limits_path)

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
