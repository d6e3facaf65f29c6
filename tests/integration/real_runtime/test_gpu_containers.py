"""GPU pods in real containers (containerd + runc on the real kubelet): the runtime applies the
device plugin's answer, the process loads the interposer from it and is held to its own slice, the
monitor reports what it really uses, and a kubelet restart leaves all of it alone.

The node's ``nvidia`` runtime (``fake_nvidia_runtime``, the RuntimeClass the webhook gives GPU
pods) puts the fake driver into the containers that ask for GPUs, as the NVIDIA container toolkit
does; each pod runs gpu-workload, which prints what a CUDA application sees (``kubectl logs``).
"""

from __future__ import annotations

import pytest
from runtime_support import NEEDS_REAL_KUBELET, OUT_OF_MEMORY, MiB, RuntimeStack, sees_only, workload
from stack_support import allocated_slots, sample_key

from hamipy.devcluster import wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.devcluster.workload_log import parse_workload_log
from hamipy.protocol import keys

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPU = FakeGpu("GPU-dddddddd-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-40GB", 40960)
OTHER = FakeGpu("GPU-dddddddd-0000-4000-8000-000000000001", "NVIDIA A100-SXM4-40GB", 40960)
GPUS = (GPU, OTHER)


async def test_a_gpu_pods_process_is_held_to_its_slice_and_a_kubelet_restart_leaves_it(
    runtime_stack: RuntimeStack,
) -> None:
    stack = runtime_stack.stack
    log, (slot,) = await runtime_stack.run_workload("one", gpu=1, gpumem=3000, gpucores=30)

    # It sees one GPU, the one it was given (its own numbering starts at 0), at its own size.
    sees_only(log, [slot.uuid], 3000)
    # The interposer was loaded from what the device plugin mounted, not from the image.
    assert await runtime_stack.loaded_the_interposer("one")

    before = (await stack.pod("one"))["status"]["containerStatuses"][0]
    await stack.kubelet_node.restart_kubelet()

    # The same container keeps running, and a second process in it is held to the same slice,
    # sharing it with the first: only what the first left is free.
    async def after_restart() -> dict[str, object] | None:
        status = (await stack.pod("one"))["status"]["containerStatuses"][0]
        exec_ok = runtime_stack.kubectl("exec", "one", "--", "sh", "-c", ":").returncode == 0
        return status if exec_ok else None

    status = await wait_for(after_restart, timeout=90, interval=0.5, what="exec into one after the restart")
    assert status is not None
    assert (status["containerID"], status["restartCount"]) == (before["containerID"], 0)
    second = await runtime_stack.exec("one", "gpu-workload", "--exit", "--chunk-mib", "64")

    facts = parse_workload_log(second)
    first_holds = int(log.one("alloc", index=0)["granted"])
    assert facts.one("device", index=0)["total"] == 3000 * MiB
    assert int(facts.one("device", index=0)["free"]) <= 3000 * MiB - first_holds
    assert facts.one("alloc", index=0)["refused_with"] == OUT_OF_MEMORY


async def test_two_pods_on_one_gpu_are_each_held_to_their_own_limit_and_the_monitor_sees_them(
    runtime_stack: RuntimeStack,
) -> None:
    stack = runtime_stack.stack
    limits = {"small": 2000, "large": 5000}
    for name, mib in limits.items():
        # Exclusive of OTHER by pinning both to GPU: the two share one GPU.
        body = stack.pod_body(name, [workload(gpu=1, gpumem=mib, gpucores=20)])
        body["metadata"]["annotations"] = {keys.USE_GPU_UUID: GPU.uuid}
        await stack.create(body)
    logs = {name: await runtime_stack.ready(name) for name in limits}
    for name, mib in limits.items():
        ((slot,),) = allocated_slots(await stack.pod(name))
        assert slot.uuid == GPU.uuid
        sees_only(logs[name], [GPU.uuid], mib)

    def used_key(name: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return sample_key(
            "hami_vgpu_memory_used_bytes",
            namespace=stack.namespace,
            pod=name,
            container="main",
            vdevice_index="0",
            device_uuid=GPU.uuid,
        )

    # The monitor reports each pod's real use, read from the region its process wrote.
    async def reported() -> dict[str, float] | None:
        metrics = await runtime_stack.metrics()
        found = {name: metrics.get(used_key(name)) for name in limits}
        return None if None in found.values() or 0.0 in found.values() else found  # type: ignore[return-value]

    usage = await wait_for(reported, timeout=60, interval=0.5, what="the monitor to report both pods")
    assert usage is not None
    for name, mib in limits.items():
        granted = int(logs[name].one("alloc", index=0)["granted"])
        assert granted <= usage[name] <= mib * MiB

    def host_used(metrics: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> float:
        (used,) = [
            value
            for (name, labels), value in metrics.items()
            if name == "hami_host_gpu_memory_used_bytes" and ("device_uuid", GPU.uuid) in labels
        ]
        return used

    # The host's NVML counts both containers' processes on the GPU, though each is pid 1 or so in
    # a PID namespace of its own.
    assert host_used(await runtime_stack.metrics()) >= sum(usage.values())

    # Deleted, a pod drops out of the monitor's report.
    await stack.core.delete_namespaced_pod("small", stack.namespace, grace_period_seconds=0)

    async def dropped() -> bool:
        metrics = await runtime_stack.metrics()
        gone = used_key("small") not in metrics and used_key("large") in metrics
        # Its process killed with it, the host's NVML forgets its use too.
        return gone and host_used(metrics) < usage["small"] + usage["large"]

    await wait_for(dropped, timeout=90, interval=0.5, what="the monitor to drop the deleted pod")
