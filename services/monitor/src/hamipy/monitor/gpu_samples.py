"""What NVML says of the node's GPUs and their MIG instances at one scrape, as plain records (pure):
``host_gpus`` makes them, the collector and ``mig_info`` read them."""

from __future__ import annotations

import dataclasses
from typing import Final

__all__ = ["HostGpuSample", "MigDeviceSample", "mig_profile"]

_MIG_NAME: Final = " MIG "


def mig_profile(nvml_name: str) -> str:
    """The profile in a MIG device's NVML name (``NVIDIA A100-SXM4-40GB MIG 1g.5gb`` -> ``1g.5gb``);
    "" for a name without one."""
    _, found, profile = nvml_name.rpartition(_MIG_NAME)
    return profile.strip() if found else ""


@dataclasses.dataclass(frozen=True, slots=True)
class MigDeviceSample:
    """One MIG instance of a MIG-enabled GPU as NVML reports it now; None where NVML could not say."""

    uuid: str
    profile: str
    gpu_instance_id: int | None
    compute_instance_id: int | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class HostGpuSample:
    """One GPU as NVML reports it now; None where NVML could not say."""

    index: int
    uuid: str
    device_type: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_percent: int | None
    mig_enabled: bool | None = False
    mig_devices: tuple[MigDeviceSample, ...] = ()
