"""A GPU node on the real runtime (containerd + runc, ``gpu_node(real_runtime=True)``) with the
monitor on it, and what the tests read from its pods: ``kubectl logs`` parsed as gpu-workload's
facts, ``kubectl exec``, the monitor's metrics."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stack_support import (
    NEEDS_REAL_KUBELET,
    GpuStack,
    Samples,
    allocated_slots,
    running_gpu_stack,
    samples,
    scrape_text,
)

from hamipy.devcluster import DevCluster, wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu, MonitorAgent
from hamipy.devcluster.images import GPU_WORKLOAD_IMAGE
from hamipy.devcluster.workload_log import WorkloadLog, parse_workload_log
from hamipy.protocol.devices import ContainerDevice

__all__ = ["NEEDS_REAL_KUBELET", "RuntimeStack", "running_runtime_stack", "sees_only", "workload"]

MiB = 1 << 20
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
KUBECTL_TIMEOUT_S = 60.0
STARTED_TIMEOUT_S = 120.0
NOT_CREATED = ("CreateContainerError", "CreateContainerConfigError", "RunContainerError")
"""Why the kubelet says a container did not start (the runtime refused what it was given): shown,
with the runtime's message, when a wait for the container times out."""


def workload(
    name: str = "main", *, args: Sequence[str] = ("--chunk-mib", "256"), **fields: Any
) -> dict[str, Any]:
    """A container running gpu-workload (``fields``: ``builders.container`` keywords)."""
    import builders

    return builders.container(
        name, image=GPU_WORKLOAD_IMAGE, imagePullPolicy="Never", args=list(args), **fields
    )


def _held_to(device: dict[str, object], alloc: dict[str, object], limit_mib: int) -> None:
    assert device["total"] == limit_mib * MiB
    assert alloc["refused_with"] == OUT_OF_MEMORY, alloc
    assert alloc["refused_name"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert alloc["granted"] == alloc["reported_free"]
    assert 0 < int(str(alloc["granted"])) <= limit_mib * MiB


def sees_only(log: WorkloadLog, uuids: Sequence[str], limit_mib: int) -> None:
    """What gpu-workload's facts must say of a process given the GPUs ``uuids`` (in the order it
    numbers them), each held to ``limit_mib``: that size, filled up to what it was told was free,
    refused past it as CUDA refuses."""
    assert log.one("driver")["devices"] == len(uuids)
    for index, uuid in enumerate(uuids):
        device = log.one("device", index=index)
        assert device["uuid"] == uuid
        _held_to(device, log.one("alloc", index=index), limit_mib)


class RuntimeStack:
    """The GPU stack on real containers, the monitor on its node, and kubectl for it."""

    def __init__(self, stack: GpuStack, devcluster: DevCluster, monitor: MonitorAgent) -> None:
        self.stack = stack
        self.devcluster = devcluster
        self.monitor = monitor

    def kubectl(self, *args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        """``kubectl`` (the cluster's own version) in the stack's namespace, as the admin or as
        ``kubeconfig``'s user."""
        return subprocess.run(
            [
                str(self.devcluster.binaries.kubectl),
                "--kubeconfig",
                str(kubeconfig or self.devcluster.access.kubeconfig),
                "--namespace",
                self.stack.namespace,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=KUBECTL_TIMEOUT_S,
            check=False,
        )

    async def logs(self, pod: str) -> WorkloadLog:
        done = await asyncio.to_thread(self.kubectl, "logs", pod)
        assert done.returncode == 0, f"kubectl logs {pod}: {done.stderr}"
        return parse_workload_log(done.stdout)

    async def ready(self, pod: str) -> WorkloadLog:
        """gpu-workload's facts once it reports ``ready`` (its allocations done, holding them)."""

        async def printed() -> WorkloadLog | None:
            status = (await self.stack.pod(pod))["status"]
            assert status.get("phase") not in ("Failed", "Succeeded"), f"{pod} ended: {status}"
            for container in status.get("containerStatuses") or ():
                waiting = (container.get("state") or {}).get("waiting") or {}
                assert waiting.get("reason") not in NOT_CREATED, f"{pod}/{container['name']}: {waiting}"
            if status.get("phase") != "Running":
                return None
            log = await self.logs(pod)
            return log if log.ready else None

        found: WorkloadLog | None = await wait_for(
            printed, timeout=STARTED_TIMEOUT_S, interval=0.5, what=f"{pod} to report ready"
        )
        assert found is not None
        return found

    async def run_workload(
        self, pod: str, *, gpu: int, gpumem: int, gpucores: int
    ) -> tuple[WorkloadLog, list[ContainerDevice]]:
        """Pod ``pod`` of one gpu-workload container asking for those GPU resources, once it
        reports ready: its facts, and the slot it was allocated."""
        await self.stack.create(
            self.stack.pod_body(pod, [workload(gpu=gpu, gpumem=gpumem, gpucores=gpucores)])
        )
        log = await self.ready(pod)
        (slot,) = allocated_slots(await self.stack.pod(pod))
        return log, slot

    async def loaded_the_interposer(self, pod: str) -> bool:
        """Whether ``pod``'s process mapped the interposer from the device plugin's mount, loaded
        by the ``/etc/ld.so.preload`` the plugin mounted (the image has none of its own)."""
        interposer = f"{self.stack.plugin.hook_path}/libvgpu.so"
        preload = await self.exec(pod, "cat", "/etc/ld.so.preload")
        return interposer in await self.exec(pod, "cat", "/proc/1/maps") and preload.strip() == interposer

    async def exec(self, pod: str, *command: str) -> str:
        done = await asyncio.to_thread(self.kubectl, "exec", pod, "--", *command)
        assert done.returncode == 0, f"kubectl exec {pod} -- {' '.join(command)}: {done.stderr}"
        return done.stdout

    async def env(self, pod: str) -> dict[str, str]:
        """The environment of a process started in ``pod`` (``kubectl exec ... env``)."""
        out = await self.exec(pod, "env")
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    async def metrics(self) -> Samples:
        return samples(await scrape_text(f"{self.monitor.url}/metrics"))


@contextlib.asynccontextmanager
async def running_runtime_stack(
    devcluster: DevCluster,
    api: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
    *,
    gpus: Sequence[FakeGpu],
    nvidia: Mapping[str, Any] | None = None,
    node_config: Mapping[str, Any] | None = None,
) -> AsyncIterator[RuntimeStack]:
    """The stack of ``running_gpu_stack`` on containerd, its plugin's ``nvidia`` settings and
    ``node_config`` (the node's ``nodeConfigs`` entry) given."""
    async with running_gpu_stack(
        devcluster,
        api,
        namespace,
        hami_scheduler,
        gpus=gpus,
        nvidia=nvidia,
        node_config=node_config,
        real_runtime=True,
        monitor_args=(),
    ) as stack:
        (monitor,) = [a for a in stack.kubelet_node.agents if isinstance(a, MonitorAgent)]
        yield RuntimeStack(stack, devcluster, monitor)
