"""The two device records every format is built from.

``DeviceInfo`` is one physical GPU as a node registers it (docs/wire-format.md#register-annotation),
with the MIG profiles (``MigProfile``, ``MigPlacement``) a dynamic MIG GPU offers;
``ContainerDevice`` is one GPU slice handed to one container (docs/wire-format.md#device-lists).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NewType

__all__ = [
    "DEVICE_MODES",
    "ContainerDevice",
    "ContainerDevices",
    "DeviceInfo",
    "DeviceMode",
    "GpuUuid",
    "MigPlacement",
    "MigProfile",
    "PodDevices",
]

GpuUuid = NewType("GpuUuid", str)
DeviceMode = Literal["hami-core", "mig", "mps"]
DEVICE_MODES: tuple[DeviceMode, ...] = ("hami-core", "mig", "mps")


@dataclasses.dataclass(frozen=True, slots=True)
class MigPlacement:
    """Where a MIG GPU instance sits: ``size`` memory slices from slice ``start`` (NVML's
    ``nvmlGpuInstancePlacement_t``; the half-open range ``[start, start + size)``)."""

    start: int
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class MigProfile:
    """One MIG profile a dynamic MIG GPU offers, as its device plugin read it from NVML: the name
    (``2g.10gb``), the instance's memory MiB, its share of the GPU's SMs in percent (rounded up),
    its memory slice count, and every placement NVML allows for it."""

    name: str
    memory_mb: int
    core: int
    slice_count: int
    placements: tuple[MigPlacement, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One physical GPU of a node, as in ``hami.io/node-nvidia-register``.

    ``devmem`` is MiB already multiplied by memory scaling; ``devcore`` is 100 times core scaling;
    ``count`` is the split count (how many containers may share the GPU). The defaults are what
    upstream's JSON means by a left-out key (Go ``omitempty``: zero values, so unhealthy), with
    ``hami-core`` for a missing mode as upstream reads it. ``mig_profiles`` is set only on a dynamic
    MIG GPU (``mode == "mig"``); a pre-made MIG instance registers as a ``mig`` device without.
    """

    id: str
    index: int = 0
    count: int = 0
    devmem: int = 0
    devcore: int = 0
    type: str = ""
    numa: int = 0
    mode: str = "hami-core"
    health: bool = False
    mig_profiles: tuple[MigProfile, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerDevice:
    """One GPU slice of one container: UUID, vendor type, memory MiB and cores percent."""

    uuid: str
    type: str
    usedmem: int
    usedcores: int


# One container's devices; a pod's list has one slot per container (init containers first).
ContainerDevices = list[ContainerDevice]
PodDevices = list[list[ContainerDevice]]
