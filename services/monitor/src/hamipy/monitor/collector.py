"""The GPU metrics, made when Prometheus scrapes (names and labels: docs/wire-format.md#metrics).

``UsageCollector.collect`` calls its ``gather`` function (the I/O: region files, NVML, the pod
cache) and turns what it returns into metric families; nothing is kept between scrapes, so a
container that is gone is gone from the next scrape.

Per container and device, labels ``namespace, pod, container, vdevice_index, device_uuid``:
``hami_vgpu_memory_limit_bytes``, ``hami_vgpu_memory_used_bytes``, ``hami_container_device_memory_bytes``
(the same use, under the name HAMi also exports), ``hami_vgpu_memory_{context,module,buffer}_bytes``,
``hami_container_device_utilization_ratio`` (SM percent, 0-100 as upstream),
``hami_container_last_kernel_elapsed_seconds`` (only where a launch was recorded), and our
``hamipy_monitor_vgpu_core_limit_ratio`` (the slice's core limit, percent).

Per host GPU, labels ``node, device_index, device_uuid, device_type``: ``hami_host_gpu_memory_used_bytes``,
``hami_host_gpu_utilization_ratio`` (percent, 0-100 as upstream) and our
``hamipy_monitor_host_gpu_memory_total_bytes`` and ``hamipy_monitor_host_gpu_mig_enabled`` (1 or 0).
Per MIG instance of a MIG-enabled GPU, the GPU's labels and ``mig_uuid, profile, gpu_instance_id,
compute_instance_id``: ``hamipy_monitor_mig_device_memory_used_bytes`` and
``hamipy_monitor_mig_device_memory_total_bytes``.

Per container device on a MIG instance, HAMi's ``hami_mig_device_info`` (value 1), labels
``namespace, pod, container, vdevice_index, device_uuid`` (the parent GPU), ``mig_uuid, profile,
gpu_instance_id, compute_instance_id`` (``mig_info``); an id that is not known is an empty label.

The monitor's view of its inputs: ``hamipy_monitor_container_region_state{namespace,pod,container,state}``
(1 for the container's state: ``ok``, ``missing``, ``unreadable``), ``hamipy_monitor_region_files{state}``,
``hamipy_monitor_orphan_region_dirs``, ``hamipy_monitor_nvml_up``.

With ``legacy`` also HAMi's pre-2.9 names: ``HostGPUMemoryUsage``, ``HostCoreUtilization``
(``nodeid, deviceidx, deviceuuid, devicetype``); ``vGPU_device_memory_usage_in_bytes``,
``vGPU_device_memory_limit_in_bytes``, ``Device_utilization_desc_of_container``,
``Device_last_kernel_of_container`` (``podnamespace, podname, ctrname, vdeviceid, deviceuuid``),
``Device_memory_desc_of_container`` with the sizes as labels ``context, module, data, offset``, and
``MigInfo`` (the same labels and ``instanceid``, the GPU instance id).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from hamipy.monitor.gpu_samples import HostGpuSample
from hamipy.monitor.mig_info import MigInfoRow
from hamipy.monitor.region_dirs import PROBLEMS, RegionReading
from hamipy.monitor.usage import DeviceRow, UsageReport

__all__ = [
    "CONTAINER_LABELS",
    "HOST_LABELS",
    "MIG_HOST_LABELS",
    "MIG_INFO_LABELS",
    "ScrapeData",
    "UsageCollector",
]

CONTAINER_LABELS: Final = ("namespace", "pod", "container", "vdevice_index", "device_uuid")
HOST_LABELS: Final = ("node", "device_index", "device_uuid", "device_type")
_MIG_IDENTITY: Final = ("mig_uuid", "profile", "gpu_instance_id", "compute_instance_id")
MIG_HOST_LABELS: Final = (*HOST_LABELS, *_MIG_IDENTITY)
MIG_INFO_LABELS: Final = (*CONTAINER_LABELS, *_MIG_IDENTITY)  # HAMi's, in its order
_LEGACY_CONTAINER_LABELS: Final = ("podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid")
_LEGACY_HOST_LABELS: Final = ("nodeid", "deviceidx", "deviceuuid", "devicetype")
_FILE_STATES: Final = ("ok", *PROBLEMS)


@dataclasses.dataclass(frozen=True, slots=True)
class ScrapeData:
    """What one scrape read: the joined usage, the region readings, the host GPUs (None when
    NVML is off or failed), and the container devices on MIG instances."""

    usage: UsageReport
    readings: Sequence[RegionReading]
    host: Sequence[HostGpuSample] | None
    mig: Sequence[MigInfoRow] = ()


def _id(value: int | None) -> str:
    return "" if value is None else str(value)


def _gauge(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class _Families:
    """One scrape's families, in a stable order."""

    def __init__(self, legacy: bool) -> None:
        c = CONTAINER_LABELS
        self.limit = _gauge("hami_vgpu_memory_limit_bytes", "vGPU device memory limit in bytes", c)
        self.used = _gauge("hami_vgpu_memory_used_bytes", "vGPU device memory usage in bytes", c)
        self.memory = _gauge(
            "hami_container_device_memory_bytes", "Container device memory usage in bytes", c
        )
        self.context = _gauge(
            "hami_vgpu_memory_context_bytes", "Container device memory context size in bytes", c
        )
        self.module = _gauge(
            "hami_vgpu_memory_module_bytes", "Container device memory module size in bytes", c
        )
        self.buffer = _gauge(
            "hami_vgpu_memory_buffer_bytes", "Container device memory buffer size in bytes", c
        )
        self.util = _gauge(
            "hami_container_device_utilization_ratio", "Container device SM utilization (percent, 0-100)", c
        )
        self.last_kernel = _gauge(
            "hami_container_last_kernel_elapsed_seconds",
            "Seconds since last kernel execution in container",
            c,
        )
        self.core_limit = _gauge(
            "hamipy_monitor_vgpu_core_limit_ratio",
            "vGPU device core (SM) limit (percent, 0-100; 0 = none)",
            c,
        )
        h = HOST_LABELS
        self.host_used = _gauge("hami_host_gpu_memory_used_bytes", "GPU device memory usage in bytes", h)
        self.host_util = _gauge("hami_host_gpu_utilization_ratio", "GPU core utilization (percent, 0-100)", h)
        self.host_total = _gauge(
            "hamipy_monitor_host_gpu_memory_total_bytes", "GPU device memory in bytes", h
        )
        self.host_mig = _gauge(
            "hamipy_monitor_host_gpu_mig_enabled", "1 when the GPU is in MIG mode (NVML), else 0", h
        )
        m = MIG_HOST_LABELS
        self.mig_used = _gauge(
            "hamipy_monitor_mig_device_memory_used_bytes", "MIG instance memory usage in bytes", m
        )
        self.mig_total = _gauge(
            "hamipy_monitor_mig_device_memory_total_bytes", "MIG instance memory in bytes", m
        )
        self.mig_info = _gauge(
            "hami_mig_device_info", "MIG runtime identity for a container allocation", MIG_INFO_LABELS
        )
        self.nvml_up = _gauge("hamipy_monitor_nvml_up", "1 when NVML answered this scrape, else 0")
        self.state = _gauge(
            "hamipy_monitor_container_region_state",
            "1 for the state of each GPU container's region: ok, missing (no CUDA yet), unreadable",
            ("namespace", "pod", "container", "state"),
        )
        self.files = _gauge("hamipy_monitor_region_files", "Region files by state at this scrape", ("state",))
        self.orphans = _gauge(
            "hamipy_monitor_orphan_region_dirs", "Region directories whose pod is not on this node"
        )
        self.legacy: list[GaugeMetricFamily] = []
        if legacy:
            lc, lh = _LEGACY_CONTAINER_LABELS, _LEGACY_HOST_LABELS
            self.l_host_used = _gauge("HostGPUMemoryUsage", "GPU device memory usage", lh)
            self.l_host_util = _gauge("HostCoreUtilization", "GPU core utilization", lh)
            self.l_used = _gauge("vGPU_device_memory_usage_in_bytes", "vGPU device usage", lc)
            self.l_limit = _gauge("vGPU_device_memory_limit_in_bytes", "vGPU device limit", lc)
            self.l_memory = _gauge(
                "Device_memory_desc_of_container",
                "Container device memory description",
                (*lc, "context", "module", "data", "offset"),
            )
            self.l_util = _gauge(
                "Device_utilization_desc_of_container", "Container device utilization description", lc
            )
            self.l_last = _gauge(
                "Device_last_kernel_of_container", "Container device last kernel description", lc
            )
            self.l_mig = _gauge("MigInfo", "Mig device information for container", (*lc, "instanceid"))
            self.legacy = [
                self.l_host_used,
                self.l_host_util,
                self.l_used,
                self.l_limit,
                self.l_memory,
                self.l_util,
                self.l_last,
                self.l_mig,
            ]

    def all(self) -> list[GaugeMetricFamily]:
        return [
            self.limit,
            self.used,
            self.memory,
            self.context,
            self.module,
            self.buffer,
            self.util,
            self.last_kernel,
            self.core_limit,
            self.host_used,
            self.host_util,
            self.host_total,
            self.host_mig,
            self.mig_used,
            self.mig_total,
            self.mig_info,
            self.nvml_up,
            self.state,
            self.files,
            self.orphans,
            *self.legacy,
        ]


class UsageCollector(Collector):
    """HAMi's monitor metrics (and ours), from ``gather()`` at each scrape."""

    def __init__(self, gather: Callable[[], ScrapeData], *, node: str, legacy: bool = False) -> None:
        self.gather = gather
        self.node = node
        self.legacy = legacy

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(_Families(self.legacy).all())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        data = self.gather()
        f = _Families(self.legacy)
        for row in data.usage.devices:
            self._device(f, row)
        for c in data.usage.containers:
            f.state.add_metric([c.namespace, c.pod, c.container, c.state], 1)
        states = collections.Counter(
            "ok" if r.snapshot is not None else r.problem for r in data.readings if r.file is not None
        )
        for state in _FILE_STATES:
            f.files.add_metric([state], states.get(state, 0))
        f.orphans.add_metric([], data.usage.orphan_dirs)
        f.nvml_up.add_metric([], 0 if data.host is None else 1)
        for gpu in data.host or ():
            self._host(f, gpu)
        for mig in data.mig:
            self._mig(f, mig)
        return iter(f.all())

    def _device(self, f: _Families, row: DeviceRow) -> None:
        labels = [row.namespace, row.pod, row.container, str(row.vdevice_index), row.device_uuid]
        f.limit.add_metric(labels, row.limit_bytes)
        f.core_limit.add_metric(labels, row.core_limit_percent)
        if row.used_bytes is not None:
            f.used.add_metric(labels, row.used_bytes)
            f.memory.add_metric(labels, row.used_bytes)
        for family, value in (
            (f.context, row.context_bytes),
            (f.module, row.module_bytes),
            (f.buffer, row.buffer_bytes),
            (f.util, row.sm_util_percent),
            (f.last_kernel, row.last_kernel_elapsed_s),
        ):
            if value is not None:
                family.add_metric(labels, value)
        if not f.legacy:
            return
        f.l_limit.add_metric(labels, row.limit_bytes)
        if row.used_bytes is not None:
            f.l_used.add_metric(labels, row.used_bytes)
        if row.sm_util_percent is not None:
            f.l_util.add_metric(labels, row.sm_util_percent)
        if row.last_kernel_elapsed_s is not None:
            f.l_last.add_metric(labels, row.last_kernel_elapsed_s)
        if row.used_bytes is not None and None not in (row.context_bytes, row.module_bytes, row.buffer_bytes):
            context, module, data = row.context_bytes or 0, row.module_bytes or 0, row.buffer_bytes or 0
            offset = row.used_bytes - context - module - data
            sizes = [str(context), str(module), str(data), str(offset)]
            f.l_memory.add_metric([*labels, *sizes], row.used_bytes)

    def _host(self, f: _Families, gpu: HostGpuSample) -> None:
        labels = [self.node, str(gpu.index), gpu.uuid, gpu.device_type]
        if gpu.memory_used_bytes is not None:
            f.host_used.add_metric(labels, gpu.memory_used_bytes)
        if gpu.memory_total_bytes is not None:
            f.host_total.add_metric(labels, gpu.memory_total_bytes)
        if gpu.utilization_percent is not None:
            f.host_util.add_metric(labels, gpu.utilization_percent)
        if gpu.mig_enabled is not None:
            f.host_mig.add_metric(labels, 1 if gpu.mig_enabled else 0)
        for mig in gpu.mig_devices:
            ids = [mig.uuid, mig.profile, _id(mig.gpu_instance_id), _id(mig.compute_instance_id)]
            if mig.memory_used_bytes is not None:
                f.mig_used.add_metric([*labels, *ids], mig.memory_used_bytes)
            if mig.memory_total_bytes is not None:
                f.mig_total.add_metric([*labels, *ids], mig.memory_total_bytes)
        if f.legacy:
            if gpu.memory_used_bytes is not None:
                f.l_host_used.add_metric(labels, gpu.memory_used_bytes)
            if gpu.utilization_percent is not None:
                f.l_host_util.add_metric(labels, gpu.utilization_percent)

    def _mig(self, f: _Families, row: MigInfoRow) -> None:
        labels = [row.namespace, row.pod, row.container, str(row.vdevice_index), row.device_uuid]
        ids = [_id(row.gpu_instance_id), _id(row.compute_instance_id)]
        f.mig_info.add_metric([*labels, row.mig_uuid, row.profile, *ids], 1)
        if f.legacy:
            f.l_mig.add_metric([*labels, ids[0]], 1)
