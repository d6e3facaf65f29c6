"""The monitor's unit tests' GPU slices, region files and fake NVML."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hamipy.monitor.gpu_samples import HostGpuSample
from hamipy.monitor.telemetry import Telemetry
from hamipy.protocol import keys
from hamipy.protocol.allocation_env import region_host_dir
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.region import MemoryUsage, ProcessUsage, build_region

MIB = 1 << 20
GPU_A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-4000-8000-000000000000"


def slice_(uuid: str = GPU_A, mem: int = 3000, cores: int = 30) -> ContainerDevice:
    return ContainerDevice(uuid, keys.DEVICE_VENDOR_NVIDIA, mem, cores)


def process(slot: int, used: Sequence[int], *, sm: Sequence[int] = (), status: int = 1) -> ProcessUsage:
    """A live process slot using ``used[i]`` bytes on device i (a tenth of it as context)."""
    return ProcessUsage(
        slot=slot,
        pid=100 + slot,
        hostpid=1000 + slot,
        status=status,
        used=tuple(MemoryUsage(u // 10, 0, u - u // 10, 0, u) for u in used),
        sm_util=tuple(sm),
    )


def region_dir(hook: Path, uid: str, container: str) -> Path:
    path = Path(region_host_dir(str(hook), uid, container))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_region(
    hook: Path,
    uid: str,
    container: str,
    *,
    name: str = "0f3c.cache",
    uuids: Sequence[str] = (GPU_A,),
    limits: Sequence[int] = (3000 * MIB,),
    sm_limits: Sequence[int] = (30,),
    processes: Sequence[ProcessUsage] = (),
    **fields: Any,
) -> Path:
    """A region file for one container, as the interposer would leave it."""
    path = region_dir(hook, uid, container) / name
    path.write_bytes(
        build_region(uuids=uuids, limits=limits, sm_limits=sm_limits, processes=processes, **fields)
    )
    return path


class FakeHostGpus:
    """Fixed host GPU samples (a ``HostGpus``)."""

    def __init__(self, samples: Sequence[HostGpuSample]) -> None:
        self.samples = list(samples)
        self.closed = False

    def sample(self) -> list[HostGpuSample]:
        return list(self.samples)

    def close(self) -> None:
        self.closed = True


def telemetry() -> tuple[Telemetry, io.StringIO]:
    stream = io.StringIO()
    return Telemetry.create(stream=stream), stream


def log_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def make_fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path
