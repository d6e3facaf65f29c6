"""What the plugin advertises, as pure functions of the GPUs NVML reports and the node's settings.

- ``Gpu``: one physical GPU as discovery (NVML) reports it; a plain record, so that this module and
  its tests need no NVML.
- ``register_devices``: the ``hami.io/node-nvidia-register`` entries
  (docs/wire-format.md#register-annotation): per GPU the split count, memory times memory scaling,
  100 times core scaling, ``NVIDIA-<model>``.
- ``kubelet_devices``: the fake device IDs ``<UUID>-<i>`` (i < split count) the kubelet counts, with
  health and NUMA topology.
- ``preferred_allocation``: which fake IDs one container should get: spread over distinct GPUs
  (HAMi #1741: otherwise the kubelet may hand a 2-GPU container two IDs of one GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import Final

from hamipy.protocol import DeviceInfo
from hamipy.protocol.config import NodeSettings
from hamipy.protocol.node_devices import device_type

__all__ = [
    "MODE_HAMI_CORE",
    "Gpu",
    "KubeletDevice",
    "gpu_of",
    "kubelet_devices",
    "preferred_allocation",
    "register_devices",
]

MODE_HAMI_CORE: Final = "hami-core"


@dataclasses.dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU as NVML reports it."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    numa: int
    """NUMA node; 0 where NVML does not know (as HAMi registers it)."""
    pci_bus_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class KubeletDevice:
    """One fake device of ``ListAndWatch``."""

    id: str
    healthy: bool
    numa: int


def registered_gpus(gpus: Iterable[Gpu], settings: NodeSettings) -> list[Gpu]:
    """The GPUs the node offers: all but those the node's ``filterDevices`` leaves out."""
    return [gpu for gpu in gpus if not settings.filtered(gpu.uuid, gpu.index)]


def register_devices(
    gpus: Iterable[Gpu], settings: NodeSettings, *, unhealthy: Collection[str] = ()
) -> list[DeviceInfo]:
    """The register annotation's devices for this node."""
    return [
        DeviceInfo(
            id=gpu.uuid,
            index=gpu.index,
            count=settings.device_split_count,
            devmem=int(gpu.memory_mib * settings.device_memory_scaling),
            devcore=int(100 * settings.device_core_scaling),
            type=device_type(gpu.name),
            numa=gpu.numa,
            mode=MODE_HAMI_CORE,
            health=gpu.uuid not in unhealthy,
        )
        for gpu in registered_gpus(gpus, settings)
    ]


def kubelet_devices(
    gpus: Iterable[Gpu], settings: NodeSettings, *, unhealthy: Collection[str] = ()
) -> list[KubeletDevice]:
    """``<UUID>-<i>`` for each registered GPU and i < split count."""
    return [
        KubeletDevice(id=f"{gpu.uuid}-{i}", healthy=gpu.uuid not in unhealthy, numa=gpu.numa)
        for gpu in registered_gpus(gpus, settings)
        for i in range(settings.device_split_count)
    ]


def gpu_of(device_id: str) -> str:
    """The GPU UUID of a fake device ID (``<UUID>-<i>``)."""
    uuid, sep, number = device_id.rpartition("-")
    return uuid if sep and number.isdigit() else device_id


def preferred_allocation(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """``size`` IDs from ``available``, ``must_include`` first, then one per GPU in turn, GPUs with
    the most free IDs first (the least shared), so a container's IDs name distinct GPUs."""
    chosen = [d for d in dict.fromkeys(must_include) if d in set(available)][:size]
    used_gpus = {gpu_of(d) for d in chosen}
    by_gpu: dict[str, list[str]] = {}
    for device in available:
        if device not in chosen:
            by_gpu.setdefault(gpu_of(device), []).append(device)
    order = sorted(by_gpu, key=lambda g: (g in used_gpus, -len(by_gpu[g]), g))
    while len(chosen) < size and any(by_gpu.values()):
        for gpu in order:
            if len(chosen) == size:
                break
            if by_gpu[gpu]:
                chosen.append(by_gpu[gpu].pop(0))
    return chosen
