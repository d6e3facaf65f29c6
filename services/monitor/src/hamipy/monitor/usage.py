"""Per-container, per-device rows of what each slice may use and what it uses (pure).

Two sources are joined on (pod UID, container name): the pod's allocation annotation (``pods``) and
the container's region file (``region_files``). For each container of each running pod on the node:

- a readable region: one row per device of the region, with its use and the limits of the
  allocation (the region's own copy is written by the container's processes, which could put
  anything there; a device the allocation does not name keeps the region's);
- no region file yet (CUDA not started, or the file still being created): the limits of the
  allocation with zero use, so that slices that have not touched the GPU are seen (HAMi #1794);
- a region that cannot be read: the limits of the allocation and *no* use values: the use is not
  known, and a zero would say it is idle. Its container state says ``unreadable``.

Containers of finished pods, and containers whose status says they have terminated, have no rows:
their slices are not in use, and a region left behind by killed processes would show stale use.
Region directories that match no container of a pod on this node are counted as orphans (they have
no names to label them with); those of pods that are gone are removed by the housekeeping.

``vdevice_index`` is the device's position in the container: in the region, NVML order of the
container's visible GPUs; in the annotation, the order of its slot. They agree in a real container,
where the runtime exposes exactly the allocated GPUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Final, Literal

from hamipy.monitor.pods import PodRecord
from hamipy.monitor.region_dirs import RegionReading
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.region import RegionSnapshot

__all__ = ["ContainerRow", "ContainerState", "DeviceRow", "UsageReport", "usage_report"]

ContainerState = Literal["ok", "missing", "unreadable"]
_MIB: Final = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceRow:
    """One device of one container. Bytes, percent and seconds; None where the value is unknown
    (an unreadable region, or no kernel launch recorded)."""

    namespace: str
    pod: str
    container: str
    vdevice_index: int
    device_uuid: str
    limit_bytes: int
    core_limit_percent: int
    used_bytes: int | None
    context_bytes: int | None
    module_bytes: int | None
    buffer_bytes: int | None
    sm_util_percent: int | None
    last_kernel_elapsed_s: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerRow:
    """Whether a GPU container's region was read (``ok``), is not there yet (``missing``) or could
    not be read (``unreadable``)."""

    namespace: str
    pod: str
    container: str
    state: ContainerState


@dataclasses.dataclass(frozen=True, slots=True)
class UsageReport:
    devices: tuple[DeviceRow, ...]
    containers: tuple[ContainerRow, ...]
    orphan_dirs: int


def _from_region(
    pod: PodRecord,
    container: str,
    snap: RegionSnapshot,
    allocated: Sequence[ContainerDevice],
    now_s: float,
) -> list[DeviceRow]:
    elapsed = max(0.0, now_s - snap.last_kernel_time) if snap.last_kernel_time > 0 else None
    granted = {dev.uuid: dev for dev in allocated}
    return [
        DeviceRow(
            namespace=pod.namespace,
            pod=pod.name,
            container=container,
            vdevice_index=dev.index,
            device_uuid=dev.uuid,
            limit_bytes=granted[dev.uuid].usedmem * _MIB if dev.uuid in granted else dev.limit_bytes,
            core_limit_percent=granted[dev.uuid].usedcores if dev.uuid in granted else dev.sm_limit,
            used_bytes=dev.used_bytes,
            context_bytes=dev.context_bytes,
            module_bytes=dev.module_bytes,
            buffer_bytes=dev.data_bytes,
            sm_util_percent=dev.sm_util,
            last_kernel_elapsed_s=elapsed,
        )
        for dev in snap.devices
    ]


def _from_allocation(
    pod: PodRecord, container: str, devices: Sequence[ContainerDevice], *, known: bool
) -> list[DeviceRow]:
    zero = 0 if known else None
    return [
        DeviceRow(
            namespace=pod.namespace,
            pod=pod.name,
            container=container,
            vdevice_index=i,
            device_uuid=dev.uuid,
            limit_bytes=dev.usedmem * _MIB,
            core_limit_percent=dev.usedcores,
            used_bytes=zero,
            context_bytes=zero,
            module_bytes=zero,
            buffer_bytes=zero,
            sm_util_percent=zero,
            last_kernel_elapsed_s=None,
        )
        for i, dev in enumerate(devices)
    ]


def usage_report(
    pods: Mapping[str, PodRecord], readings: Sequence[RegionReading], *, now_s: float
) -> UsageReport:
    """The rows of every GPU container of this node's running pods (module docstring has the rules);
    ``now_s`` is the current Unix time, for the seconds since the last kernel."""
    by_container = {(r.dir.pod_uid, r.dir.container): r for r in readings}
    devices: list[DeviceRow] = []
    containers: list[ContainerRow] = []
    for pod in sorted(pods.values(), key=lambda p: (p.namespace, p.name, p.uid)):
        if pod.terminal:
            continue
        for name in pod.containers:
            if name in pod.terminated:
                continue
            reading = by_container.get((pod.uid, name))
            allocated = pod.allocations.get(name, ())
            state: ContainerState
            if reading is not None and reading.snapshot is not None:
                devices += _from_region(pod, name, reading.snapshot, allocated, now_s)
                state = "ok"
            elif reading is not None and reading.problem not in (None, "uninitialised"):
                devices += _from_allocation(pod, name, allocated, known=False)
                state = "unreadable"
            elif allocated:
                devices += _from_allocation(pod, name, allocated, known=True)
                state = "missing"
            else:
                continue  # a container without GPU and without region
            containers.append(ContainerRow(pod.namespace, pod.name, name, state))
    known = {(p.uid, name) for p in pods.values() for name in p.containers}
    orphans = sum(1 for r in readings if (r.dir.pod_uid, r.dir.container) not in known)
    return UsageReport(devices=tuple(devices), containers=tuple(containers), orphan_dirs=orphans)
