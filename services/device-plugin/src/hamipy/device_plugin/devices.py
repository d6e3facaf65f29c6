"""What the plugin advertises, as pure functions of the GPUs NVML reports and the node's settings.

- ``Gpu``: one physical GPU as discovery (NVML) reports it; a plain record, so that this module and
  its tests need no NVML.
- ``register_devices``: the ``hami.io/node-nvidia-register`` entries
  (docs/wire-format.md#register-annotation): per GPU the split count, memory times memory scaling,
  100 times core scaling, ``NVIDIA-<model>``.
- ``kubelet_devices``: the fake device IDs ``<UUID>-<i>`` (i < split count) the kubelet counts, with
  health and NUMA topology.
- ``gpu_of``: the GPU of a fake ID; ``preferred_ids``: the fake IDs a container should get, one on
  each GPU the scheduler planned for it (the kubelet's IDs must name exactly those GPUs at Allocate).
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
    "preferred_ids",
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
    """The GPU UUID of a fake device ID (``<UUID>-<i>``); the ID itself when it has no ``-<i>``."""
    uuid, sep, number = device_id.rpartition("-")
    return uuid if sep and number.isascii() and number.isdigit() else device_id


def preferred_ids(planned: Sequence[str], available: Sequence[str], must_include: Sequence[str]) -> list[str]:
    """One ID from ``available`` on each GPU of ``planned`` (UUIDs, in that order), the
    ``must_include`` ones for their GPUs; empty when that cannot be done: a planned GPU with no
    available ID, or a ``must_include`` ID on a GPU not planned (or two on one GPU)."""
    chosen: dict[str, str] = {}
    for device in dict.fromkeys(must_include):
        gpu = gpu_of(device)
        if gpu not in planned or gpu in chosen:
            return []
        chosen[gpu] = device
    for gpu in planned:
        if gpu not in chosen:
            found = next((d for d in available if gpu_of(d) == gpu and d not in must_include), None)
            if found is None:
                return []
            chosen[gpu] = found
    return [chosen[gpu] for gpu in planned]
