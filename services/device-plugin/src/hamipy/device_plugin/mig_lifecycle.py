"""The lifecycle of dynamic MIG instances on a ``mig`` node: made at Allocate, destroyed after the
pod, adopted after a restart (docs/device-plugin.md#dynamic-mig-lifecycle).

- ``sync``: the first time (and until it succeeds), HAMi's startup: the GPUs in use are those an
  active pod's record names and those a process runs on; every other GPU is reset (MIG mode on, all
  instances destroyed); then each active pod's record that has its MIG UUID and ids is adopted when
  NVML shows that instance, else a Warning Event ``MigAllocationNotLive`` on the pod and a log line.
  Afterwards, a reconcile: instances on the node's dynamic GPUs that no active pod's record holds
  are destroyed (each a log line and a Normal Event ``MigInstanceDestroyed`` on the node). The pods
  come from a fresh list: when it fails, nothing is reset or destroyed.
- ``realise``: a container's records made real (``MigManager.ensure`` each, in device order); what
  this call made is destroyed again (``rollback``) when a later step of the Allocate fails.

Everything runs under ``lock``: the Allocate that makes instances holds it from its reconcile to its
annotation write, so a reconcile never works from a pod list older than an instance.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

from hamipy.device_plugin.errors import MigError
from hamipy.device_plugin.kube import NodeKube
from hamipy.device_plugin.mig_manager import LiveInstance, MigInstance, MigManager
from hamipy.device_plugin.mig_records import (
    PodRecords,
    active_records,
    container_records,
    desired_keys,
    key_of,
    pod_records,
)
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.errors import KubeError
from hamipy.kube.events import EventRecorder
from hamipy.protocol import ContainerDevice, ProtocolError
from hamipy.protocol.mig_allocations import MigAllocation, encode_mig_allocations, with_runtime

__all__ = ["DESTROYED_REASON", "NOT_LIVE_REASON", "MigLifecycle", "Realised"]

DESTROYED_REASON: Final = "MigInstanceDestroyed"
NOT_LIVE_REASON: Final = "MigAllocationNotLive"
_FULL_CORES: Final = 100
"""A MIG instance is its own compute: the interposer does not throttle within it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Realised:
    """A container's MIG instances: its devices for the answer, the pod's records with their
    runtime identity, and what this call made (to roll back)."""

    devices: list[ContainerDevice]
    annotation: str
    made: list[MigInstance]


class MigLifecycle:
    """Dynamic MIG on this node's ``gpus`` (parent UUIDs)."""

    def __init__(
        self,
        *,
        manager: MigManager,
        api: NodeKube,
        gpus: Sequence[str],
        telemetry: Telemetry,
        events: EventRecorder,
    ) -> None:
        self.manager = manager
        self.api = api
        self.gpus = list(gpus)
        self.logger = telemetry.logger.bind(node=api.node_name)
        self.events = events
        self.lock = asyncio.Lock()
        self.started = False

    @property
    def _node(self) -> dict[str, str]:
        return {"kind": "Node", "name": self.api.node_name, "uid": self.api.node_name}

    def serves(self, devices: Sequence[ContainerDevice]) -> bool:
        """Whether a container's devices are on dynamic MIG GPUs."""
        return any(d.uuid in self.gpus for d in devices)

    async def _records(self) -> list[PodRecords] | None:
        """The active pods' records from a fresh list; None (logged) when they cannot be read."""
        try:
            pods, _ = await self.api.node_pods()
            return active_records(pods)
        except (KubeError, ProtocolError) as exc:
            self.logger.error("MIG instances left as they are: this node's pods not known", error=str(exc))
            return None

    async def sync(self) -> None:
        """Startup (until it once succeeds), else a reconcile. Call with ``lock`` held."""
        records = await self._records()
        if records is None:
            return
        if not self.started:
            await self._start(records)
            self.started = True
            return
        await self._reconcile(records)

    async def _start(self, records: list[PodRecords]) -> None:
        named = {r.gpu_uuid for pod in records for r in pod.records}
        busy = await asyncio.to_thread(self.manager.busy_gpus, self.gpus)
        in_use = named | busy
        try:
            reset = await asyncio.to_thread(self.manager.reset_idle, self.gpus, in_use)
        except MigError as exc:
            reset = []
            self.logger.error("MIG GPU reset failed", error=str(exc))
        self.logger.info("MIG startup layout", in_use=sorted(in_use), reset=reset)
        for pod in records:
            for record in pod.runtime_ready():
                await self._adopt(pod, record)
        await self._reconcile(records)

    async def _adopt(self, pod: PodRecords, record: MigAllocation) -> None:
        assert record.mig_uuid is not None
        assert record.gpu_instance_id is not None
        assert record.compute_instance_id is not None
        log = self.logger.bind(namespace=pod.namespace, pod=pod.name, uid=pod.uid, mig_uuid=record.mig_uuid)
        try:
            await asyncio.to_thread(
                self.manager.adopt,
                key_of(record),
                mig_uuid=record.mig_uuid,
                gpu_instance_id=record.gpu_instance_id,
                compute_instance_id=record.compute_instance_id,
            )
        except MigError as exc:
            log.warning("MIG allocation not adopted: not live", error=str(exc))
            message = f"MIG device {record.mig_uuid} ({key_of(record)}) is not live: {exc}"
            self.events.emit(pod.involved, NOT_LIVE_REASON, message, warning=True)
            return
        log.info("MIG allocation adopted", instance=str(key_of(record)))

    async def _reconcile(self, records: list[PodRecords]) -> None:
        desired = desired_keys(records, self.gpus)
        done = await asyncio.to_thread(self.manager.reconcile, desired, self.gpus)
        for gone in done.destroyed:
            what = _describe(gone)
            self.logger.info("MIG instance destroyed: no active pod holds it", instance=what)
            self.events.emit(
                self._node, DESTROYED_REASON, f"MIG instance {what} destroyed: no active pod holds it"
            )
        for instance, error in done.failed:
            self.logger.warning(
                "MIG instance not destroyed; retried", instance=_describe(instance), error=error
            )

    async def realise(
        self, pod: Mapping[str, Any], *, slot: int, devices: Sequence[ContainerDevice]
    ) -> Realised:
        """Make the container ``slot``'s instances (``MigError``, ``ProtocolError``; what this
        call made is destroyed again before it raises). Call with ``lock`` held."""
        records = pod_records(pod)
        mine = container_records(records, slot, [d.uuid for d in devices])
        made: list[MigInstance] = []
        runtime: dict[tuple[int, int], MigAllocation] = {}
        out = []
        try:
            for record, device in zip(mine, devices, strict=True):
                instance, new = await asyncio.to_thread(self.manager.ensure, key_of(record))
                if new:
                    made.append(instance)
                runtime[(record.container_index, record.device_index)] = with_runtime(
                    record, instance.mig_uuid, instance.gpu_instance_id, instance.compute_instance_id
                )
                out.append(
                    dataclasses.replace(
                        device, uuid=instance.mig_uuid, usedmem=instance.memory_mib, usedcores=_FULL_CORES
                    )
                )
        except (MigError, ProtocolError):
            await self.rollback(made)
            raise
        updated = [runtime.get((r.container_index, r.device_index), r) for r in records]
        return Realised(out, encode_mig_allocations(updated), made)

    async def rollback(self, made: Sequence[MigInstance]) -> None:
        """Destroy instances an Allocate made, newest first; a failure is logged (the reconcile
        destroys it later: no active pod's record names it)."""
        for instance in reversed(made):
            try:
                await asyncio.to_thread(self.manager.release, instance.key)
            except MigError as exc:
                self.logger.error(
                    "MIG instance not rolled back", instance=_describe(instance), error=str(exc)
                )
            else:
                self.logger.info("MIG instance rolled back", instance=_describe(instance))

    async def run(self, interval_s: float) -> None:
        """``sync`` every ``interval_s``, forever."""
        while True:
            async with self.lock:
                await self.sync()
            await asyncio.sleep(interval_s)


def _describe(instance: MigInstance | LiveInstance) -> str:
    if isinstance(instance, MigInstance):
        return f"{instance.mig_uuid} ({instance.key}, GPU instance {instance.gpu_instance_id})"
    if instance.gpu_instance_id < 0:
        return f"the instances of GPU {instance.gpu_uuid}"
    return (
        f"GPU instance {instance.gpu_instance_id} at {instance.start}+{instance.size} on {instance.gpu_uuid}"
    )
