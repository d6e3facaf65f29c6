"""The monitor's unit tests' pods (``builders.pod`` as on their node) and region files, and fakes of
the API and NVML."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import builders

from hamipy.kube.errors import KubeError
from hamipy.monitor.host_gpus import HostGpuSample
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


def pod_json(
    name: str,
    *,
    uid: str | None = None,
    namespace: str = "team-a",
    containers: Sequence[str] = ("main",),
    init: Sequence[str] = (),
    slots: Sequence[Sequence[ContainerDevice]] | None = None,
    annotation: str | None = None,
    phase: str = "Running",
    terminated: Sequence[str] = (),
    resource_version: str = "1",
) -> dict[str, Any]:
    """``builders.pod`` as the monitor's node sees it: on ``gpu-node``, uid ``uid-<name>``, with the
    ``vgpu-devices-allocated`` annotation from ``slots`` (init containers first) or as written in
    ``annotation``, and the ``terminated`` containers' statuses."""
    pod = builders.pod(
        name,
        *(builders.container(c) for c in containers),
        init=[builders.container(c) for c in init],
        namespace=namespace,
        uid=uid or f"uid-{name}",
        resource_version=resource_version,
        annotations=builders.allocation(allocated=annotation if annotation is not None else slots),
        node_name="gpu-node",
        phase=phase,
    )
    pod["status"]["containerStatuses"] = [
        {"name": c, "state": {"terminated": {"exitCode": 0}}} for c in terminated
    ]
    pod["status"]["initContainerStatuses"] = []
    return pod


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


class FakePodsApi:
    """An API server that lists ``pods`` and then delivers queued watch events (a ``KubeApi``):
    an event, ``None`` (the server ends this watch) or an exception (raised in the stream)."""

    def __init__(self, pods: Sequence[dict[str, Any]] = (), *, version: str = "10") -> None:
        self.pods = list(pods)
        self.version = version
        self.events: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()
        self.lists = 0
        self.fail_lists = 0

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str = "application/json",
        timeout_s: float = 10.0,
    ) -> Any:
        assert (method, path) == ("GET", "/api/v1/pods")
        assert dict(query)["fieldSelector"] == "spec.nodeName=gpu-node"
        if self.fail_lists:
            self.fail_lists -= 1
            raise KubeError("GET /api/v1/pods: HTTP 500: boom", status=500)
        self.lists += 1
        items = [json.loads(json.dumps(p)) for p in self.pods]
        return {"items": items, "metadata": {"resourceVersion": self.version}}

    async def stream(
        self, path: str, *, query: Sequence[tuple[str, str]], inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        while True:
            event = await self.events.get()
            if event is None:
                return
            if isinstance(event, BaseException):
                raise event
            yield event


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
