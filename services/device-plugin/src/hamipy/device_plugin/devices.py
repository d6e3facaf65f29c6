"""What the plugin advertises, as pure functions of the GPUs NVML reports and the node's settings.

- ``Gpu``: one physical GPU as discovery (NVML) reports it; a plain record, so that this module and
  its tests need no NVML.
- ``register_devices``: the ``hami.io/node-nvidia-register`` entries
  (docs/wire-format.md#register-annotation): per GPU the split count, memory times memory scaling,
  100 times core scaling, ``NVIDIA-<model>``.
- MIG (docs/device-plugin.md#mig): on a node whose ``operatingmode`` is ``mig`` each GPU with an
  allowed profile registers ``mode: mig`` with its profiles (the scheduler picks one at a placement;
  the plugin makes the instance at Allocate), a GPU with none is not registered; elsewhere a GPU in
  MIG mode registers its existing instances, one entry each, under ``migStrategy`` ``single`` or
  ``mixed``, and not at all under ``none`` (``mig_findings`` says which GPUs were left out and why).
- ``kubelet_devices``: the fake device IDs ``<id>-<i>`` (i below the entry's count: the split count,
  a MIG GPU's instance capacity, 1 for an instance) the kubelet counts, with health and NUMA topology.
- ``gpu_of``: the GPU of a fake ID; ``preferred_ids``: the fake IDs a container should get, one on
  each GPU the scheduler planned for it (the kubelet's IDs must name exactly those GPUs at Allocate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import Final

from hamipy.protocol import DeviceInfo
from hamipy.protocol.config import NodeSettings
from hamipy.protocol.devices import MigProfile
from hamipy.protocol.node_devices import device_type

__all__ = [
    "MIG_GPU_SKIPPED",
    "MIG_NO_PROFILE",
    "MIG_SINGLE_UNSPLIT",
    "MODE_HAMI_CORE",
    "MODE_MIG",
    "Gpu",
    "KubeletDevice",
    "MigDevice",
    "MigFinding",
    "dynamic_mig_gpus",
    "gpu_of",
    "kubelet_devices",
    "mig_findings",
    "preferred_ids",
    "register_devices",
]

MODE_HAMI_CORE: Final = "hami-core"
MODE_MIG: Final = "mig"
MIG_GPU_SKIPPED: Final = "MigEnabledGpuSkipped"
"""Event reason: a GPU in MIG mode on a node whose ``migStrategy`` is ``none``."""
MIG_NO_PROFILE: Final = "MigGpuWithoutProfile"
"""Event reason: a GPU of a ``mig`` node with no allowed profile NVML gives."""
MIG_SINGLE_UNSPLIT: Final = "MigStrategySingle"
"""A GPU of a ``single`` node that is not in MIG mode or has no instance: the plugin does not start."""


@dataclasses.dataclass(frozen=True, slots=True)
class MigDevice:
    """A MIG instance that exists on a GPU (static MIG)."""

    uuid: str
    profile: str
    memory_mib: int
    core: int
    """Its SMs as a percentage of the whole GPU's, rounded up."""


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
    mig_enabled: bool = False
    """MIG mode is on now."""
    mig_profiles: tuple[MigProfile, ...] = ()
    """The allowed profiles NVML gives (read on ``mig`` nodes only)."""
    mig_capacity: int = 0
    """The most instances any of ``mig_profiles`` allows."""
    mig_devices: tuple[MigDevice, ...] = ()
    """The instances that exist (MIG mode on)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MigFinding:
    """A GPU left out of the register annotation, or a node that cannot be served, with why."""

    gpu: Gpu
    reason: str
    """``MIG_GPU_SKIPPED``, ``MIG_NO_PROFILE`` or ``MIG_SINGLE_UNSPLIT``."""
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class KubeletDevice:
    """One fake device of ``ListAndWatch``."""

    id: str
    healthy: bool
    numa: int


def registered_gpus(gpus: Iterable[Gpu], settings: NodeSettings) -> list[Gpu]:
    """The GPUs the node offers: all but those the node's ``filterDevices`` leaves out."""
    return [gpu for gpu in gpus if not settings.filtered(gpu.uuid, gpu.index)]


def _dynamic(settings: NodeSettings) -> bool:
    return settings.operating_mode == MODE_MIG


def dynamic_mig_gpus(gpus: Iterable[Gpu], settings: NodeSettings) -> list[Gpu]:
    """The GPUs whose MIG instances the plugin makes at Allocate: a ``mig`` node's registered GPUs."""
    if not _dynamic(settings):
        return []
    return [gpu for gpu in registered_gpus(gpus, settings) if gpu.mig_profiles]


def mig_findings(gpus: Iterable[Gpu], settings: NodeSettings) -> list[MigFinding]:
    """The GPUs MIG leaves out of the register annotation, and (``MIG_SINGLE_UNSPLIT``) why a
    ``single`` node cannot be served: every GPU must be in MIG mode with an instance."""
    out = []
    for gpu in registered_gpus(gpus, settings):
        if _dynamic(settings):
            if not gpu.mig_profiles:
                out.append(
                    MigFinding(
                        gpu,
                        MIG_NO_PROFILE,
                        f"GPU {gpu.uuid} ({gpu.name}) has no allowed MIG profile NVML gives; not registered",
                    )
                )
        elif settings.mig_strategy == "single" and not gpu.mig_devices:
            state = "has no MIG instance" if gpu.mig_enabled else "is not in MIG mode"
            out.append(
                MigFinding(
                    gpu, MIG_SINGLE_UNSPLIT, f"migStrategy single: GPU {gpu.uuid} ({gpu.name}) {state}"
                )
            )
        elif settings.mig_strategy == "none" and gpu.mig_enabled:
            out.append(
                MigFinding(
                    gpu,
                    MIG_GPU_SKIPPED,
                    f"GPU {gpu.uuid} ({gpu.name}) is in MIG mode and migStrategy is none; not registered",
                )
            )
    return out


def _entries(gpu: Gpu, settings: NodeSettings, healthy: bool) -> list[DeviceInfo]:
    kind = device_type(gpu.name)
    if _dynamic(settings):
        if not gpu.mig_profiles:
            return []
        return [
            DeviceInfo(
                id=gpu.uuid,
                index=gpu.index,
                count=gpu.mig_capacity,
                devmem=gpu.memory_mib,
                devcore=100,
                type=kind,
                numa=gpu.numa,
                mode=MODE_MIG,
                health=healthy,
                mig_profiles=gpu.mig_profiles,
            )
        ]
    if gpu.mig_enabled:
        if settings.mig_strategy == "none":
            return []
        return [
            DeviceInfo(
                id=mig.uuid,
                index=gpu.index,
                count=1,
                devmem=mig.memory_mib,
                devcore=mig.core,
                # NVML's name of the instance (``<GPU> MIG 3g.40gb``): a type selector naming the
                # model still matches, and one naming the profile picks it.
                type=device_type(f"{gpu.name} MIG {mig.profile}"),
                numa=gpu.numa,
                mode=MODE_MIG,
                health=healthy,
            )
            for mig in gpu.mig_devices
        ]
    return [
        DeviceInfo(
            id=gpu.uuid,
            index=gpu.index,
            count=settings.device_split_count,
            devmem=int(gpu.memory_mib * settings.device_memory_scaling),
            devcore=int(100 * settings.device_core_scaling),
            type=kind,
            numa=gpu.numa,
            mode=MODE_HAMI_CORE,
            health=healthy,
        )
    ]


def register_devices(
    gpus: Iterable[Gpu], settings: NodeSettings, *, unhealthy: Collection[str] = ()
) -> list[DeviceInfo]:
    """The register annotation's devices for this node (a MIG instance is healthy as its GPU)."""
    return [
        entry
        for gpu in registered_gpus(gpus, settings)
        for entry in _entries(gpu, settings, gpu.uuid not in unhealthy)
    ]


def kubelet_devices(
    gpus: Iterable[Gpu], settings: NodeSettings, *, unhealthy: Collection[str] = ()
) -> list[KubeletDevice]:
    """``<id>-<i>`` for each registered device and i below its count."""
    return [
        KubeletDevice(id=f"{device.id}-{i}", healthy=device.health, numa=device.numa)
        for device in register_devices(gpus, settings, unhealthy=unhealthy)
        for i in range(device.count)
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
