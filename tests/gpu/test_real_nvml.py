"""The device plugin's discovery and node registration, and the monitor's host GPU
metrics, over the real NVML, in-process (no cluster).

Every expected value is read from ``pynvml`` here, independently of our code: UUID, name, memory
and PCI bus ID per NVML index. NUMA is compared with the source the plugin reads,
``nvmlDeviceGetNumaNodeId`` (an error or a negative node registers as 0, as HAMi's "unknown");
the kernel's ``/sys/bus/pci/devices/<bus>/numa_node`` (near what HAMi reads: the NUMA Affinity
column of ``nvidia-smi topo -m``) is recorded beside it, not asserted.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import pytest

pytest.importorskip("pynvml", reason="needs nvidia-ml-py (pynvml)")
pytest.importorskip("prometheus_client.parser", reason="needs prometheus-client")
pytest.importorskip(
    "hamipy.device_plugin.node_registration", reason="needs the device plugin's dependencies installed"
)
pytest.importorskip("hamipy.monitor.collector", reason="needs the monitor's dependencies installed")

import pynvml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hamipy.device_plugin.devices import Gpu
from hamipy.device_plugin.discovery import discover_gpus
from hamipy.device_plugin.inventory import Inventory
from hamipy.device_plugin.node_registration import write_node_register
from hamipy.monitor.collector import HOST_LABELS, ScrapeData, UsageCollector
from hamipy.monitor.host_gpus import NvmlHostGpus
from hamipy.monitor.telemetry import Telemetry
from hamipy.monitor.usage import UsageReport
from hamipy.protocol import decode_node_devices, keys
from hamipy.protocol.config import Config

if TYPE_CHECKING:
    from hamipy.device_plugin.kube import NodeKube

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nvml")]

NODE: Final = "gpu-node"
MIB: Final = 1 << 20
USED_TOLERANCE_BYTES: Final = 256 * MIB
"""Memory in use moves between two reads (other processes, the driver): the monitor's value must
lie within this of pynvml's reads just before and just after the scrape."""

Labels = frozenset[tuple[str, str]]


class GpuResults(Protocol):
    """The session recorder tests/gpu/conftest.py provides (``gpu_results``)."""

    def record(self, section: str, data: dict[str, object]) -> None: ...


@pytest.fixture(scope="module")
def nvml() -> Iterator[None]:
    """pynvml initialised for this module's own reads (NVML counts nested inits: our code's
    init and shutdown leave this one standing)."""
    pynvml.nvmlInit()
    yield
    pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _nvml_numa(handle: Any) -> int | str:
    """``nvmlDeviceGetNumaNodeId`` as NVML answers it: the node, or the error's text."""
    try:
        return int(pynvml.nvmlDeviceGetNumaNodeId(handle))
    except pynvml.NVMLError as exc:
        return f"error: {exc}"


def _sysfs_numa(bus_id: str) -> int | None:
    """The kernel's NUMA node of the PCI device (``00000000:3B:00.0`` -> ``0000:3b:00.0``)."""
    try:
        return int(Path("/sys/bus/pci/devices", bus_id[-12:].lower(), "numa_node").read_text())
    except (OSError, ValueError):
        return None


def _expected_gpus() -> list[Gpu]:
    """Every GPU as pynvml reports it, with NUMA mapped as HAMi registers it."""
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        numa = _nvml_numa(handle)
        gpus.append(
            Gpu(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
                numa=max(numa, 0) if isinstance(numa, int) else 0,
                pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
            )
        )
    return gpus


def _register_type(name: str) -> str:
    return name if name.upper().startswith("NVIDIA") else f"NVIDIA-{name}"


def _labels(gpu: Gpu, *, legacy: bool = False) -> Labels:
    """The monitor's host GPU labels for ``gpu`` (HAMi's pre-2.9 names with ``legacy``)."""
    names = ("nodeid", "deviceidx", "deviceuuid", "devicetype") if legacy else HOST_LABELS
    return frozenset(zip(names, (NODE, str(gpu.index), gpu.uuid, _register_type(gpu.name)), strict=True))


class _RecordingNode:
    """Stands in for ``NodeKube``: keeps the annotations the plugin writes."""

    def __init__(self) -> None:
        self.written: list[dict[str, str | None]] = []

    async def patch_node_annotations(
        self, annotations: Mapping[str, str | None], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        self.written.append(dict(annotations))
        return {"metadata": {"name": NODE, "annotations": dict(annotations)}}


def test_discovery_and_register_annotation_match_nvml(gpu_results: GpuResults) -> None:
    """``discover_gpus`` finds exactly the GPUs pynvml reports (index, UUID, name, memory MiB,
    NUMA, PCI bus), and the register annotation the plugin writes decodes back to each of them with
    HAMi's defaults: 10 slots, all of its memory (scaling 1.0), 100 cores, ``hami-core``, healthy."""
    started = time.perf_counter()
    gpus = discover_gpus()
    discovery_ms = (time.perf_counter() - started) * 1000
    expected = _expected_gpus()
    assert expected, "NVML reports no GPU"
    assert gpus == expected
    for gpu in gpus:
        assert gpu.uuid.startswith("GPU-"), gpu.uuid
        assert gpu.name
        assert gpu.memory_mib > 0

    settings = Config().for_node(NODE)
    assert (settings.device_split_count, settings.device_memory_scaling, settings.device_core_scaling) == (
        10,
        1.0,
        1.0,
    )
    inventory = Inventory(gpus, settings)
    node = _RecordingNode()
    value = asyncio.run(write_node_register(cast("NodeKube", node), inventory))
    (written,) = node.written
    assert written[keys.NODE_REGISTER] == value
    assert str(written[keys.NODE_HANDSHAKE]).startswith("Reported_")
    registered = decode_node_devices(value)
    assert [
        (d.id, d.index, d.count, d.devmem, d.devcore, d.type, d.numa, d.mode, d.health) for d in registered
    ] == [
        (g.uuid, g.index, 10, g.memory_mib, 100, _register_type(g.name), g.numa, "hami-core", True)
        for g in expected
    ]
    # The kubelet's view: <UUID>-<i> for i < 10 on every GPU, with that GPU's NUMA node.
    assert [(k.id, k.healthy, k.numa) for k in inventory.kubelet_devices()] == [
        (f"{g.uuid}-{i}", True, g.numa) for g in expected for i in range(10)
    ]

    handles = [pynvml.nvmlDeviceGetHandleByIndex(g.index) for g in expected]
    cuda = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
    gpu_results.record(
        "nvml",
        {
            "driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
            "nvml_cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "device_count": len(expected),
            "device_names": [g.name for g in expected],
            "memory_total_mib": [g.memory_mib for g in expected],
            "uuids": [g.uuid for g in expected],
            "pci_bus_ids": [g.pci_bus_id for g in expected],
            "numa_registered": [g.numa for g in gpus],
            "numa_nvml": [_nvml_numa(h) for h in handles],
            "numa_sysfs": [_sysfs_numa(g.pci_bus_id) for g in expected],
            "discovery_ms": round(discovery_ms, 2),
            "register_annotation": value,
        },
    )


def _scrape(collector_registry: Any) -> dict[tuple[str, Labels], float]:
    """The ``/metrics`` text the monitor renders, parsed back: value by sample name and labels."""
    text = generate_latest(collector_registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _used_bytes() -> list[int]:
    return [
        int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used)
        for i in range(pynvml.nvmlDeviceGetCount())
    ]


def _utilization(index: int) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(index)).gpu)
    except pynvml.NVMLError_NotSupported:
        return None


def test_monitor_host_metrics_match_nvml(gpu_results: GpuResults) -> None:
    """The monitor's scrape over the real NVML exposes every GPU pynvml reports, under its index,
    UUID and type: memory total exactly, memory used within 256 MiB of pynvml's reads around the
    scrape, utilization a percent in [0, 100] (or absent where pynvml has none); HAMi's legacy
    ``HostGPUMemoryUsage``/``HostCoreUtilization`` carry the same values; ``nvml_up`` is 1 and no
    NVML call failed."""
    expected = _expected_gpus()
    telemetry = Telemetry.create(stream=io.StringIO())
    host = NvmlHostGpus(logger=telemetry.logger, metrics=telemetry.metrics)
    empty = UsageReport((), (), 0)
    telemetry.metrics.registry.register(
        UsageCollector(
            lambda: ScrapeData(usage=empty, readings=(), host=host.sample()), node=NODE, legacy=True
        )
    )
    try:
        host.sample()  # the first sample initialises NVML; the timed scrape below is a steady one
        before = _used_bytes()
        started = time.perf_counter()
        samples = _scrape(telemetry.metrics.registry)
        scrape_ms = (time.perf_counter() - started) * 1000
        after = _used_bytes()
    finally:
        host.close()
        telemetry.shutdown()

    assert samples[("hamipy_monitor_nvml_up", frozenset())] == 1
    assert not [k for k in samples if k[0] == "hamipy_monitor_nvml_errors_total" and samples[k]]
    reported = {dict(labels)["device_uuid"] for name, labels in samples if name.startswith("hami_host_gpu_")}
    assert reported == {g.uuid for g in expected}

    utilization: list[float | None] = []
    used_mib: list[float] = []
    for gpu in expected:
        labels, legacy = _labels(gpu), _labels(gpu, legacy=True)
        total = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(gpu.index)).total)
        assert samples[("hamipy_monitor_host_gpu_memory_total_bytes", labels)] == total
        used = samples[("hami_host_gpu_memory_used_bytes", labels)]
        low, high = sorted((before[gpu.index], after[gpu.index]))
        assert low - USED_TOLERANCE_BYTES <= used <= high + USED_TOLERANCE_BYTES, (used, low, high)
        assert samples[("HostGPUMemoryUsage", legacy)] == used
        util = samples.get(("hami_host_gpu_utilization_ratio", labels))
        if _utilization(gpu.index) is None:
            assert util is None
        else:
            assert util is not None
            assert 0 <= util <= 100
            assert samples[("HostCoreUtilization", legacy)] == util
        utilization.append(util)
        used_mib.append(round(used / MIB, 1))

    gpu_results.record(
        "monitor_host_metrics",
        {
            "scrape_ms": round(scrape_ms, 2),
            "memory_used_mib": used_mib,
            "utilization_percent": utilization,
        },
    )
