"""Dynamic MIG on the real control plane and real containers: the extender picks an instance's
profile and placement, the device plugin makes that instance at Allocate, the pod's process sees
only the instance, and the instance lives exactly as long as the pod, through a device plugin
killed and started again.

The node's device plugin runs with ``operatingmode: mig`` over two A100 40GB of the fake driver,
whose MIG state (modes, GPU and compute instances, MIG UUIDs) is shared by every process on the
node, as a real driver's is: ``mig_support`` reads it through pynvml beside the plugin.
"""

from __future__ import annotations

from typing import Any

import pytest
from mig_support import MigInstance, make_instance, mig_instances
from runtime_support import NEEDS_REAL_KUBELET, OUT_OF_MEMORY, MiB, RuntimeStack, workload
from stack_support import GpuStack, allocated_slots, sample_key

from hamipy.devcluster import wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.devcluster.workload_log import WorkloadLog
from hamipy.protocol import keys
from hamipy.protocol.devices import MigPlacement
from hamipy.protocol.mig_allocations import MigAllocation, decode_mig_allocations, runtime_ready

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPUS = (
    FakeGpu("GPU-d1600000-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-40GB", 40960),
    FakeGpu("GPU-d1600000-0000-4000-8000-000000000001", "NVIDIA A100-SXM4-40GB", 40960),
)
NODE_CONFIG = {"operatingmode": "mig"}
GONE_TIMEOUT_S = 60.0


async def create_mig_pod(stack: GpuStack, name: str, mib: int, **annotations: str) -> None:
    body = stack.pod_body(name, [workload(gpu=1, gpumem=mib)])
    body["metadata"]["annotations"] = {keys.VGPU_MODE: "mig", **annotations}
    await stack.create(body)


async def record_of(stack: GpuStack, name: str) -> MigAllocation:
    """The pod's one MIG reservation, as the device plugin completed it."""
    pod = await stack.pod(name)
    (record,) = decode_mig_allocations(pod["metadata"]["annotations"][keys.MIG_ALLOCATIONS])
    assert runtime_ready(record), record
    return record


def instance_of(instances: list[MigInstance], record: MigAllocation) -> MigInstance:
    (found,) = [i for i in instances if i["uuid"] == record.mig_uuid]
    assert (found["gpu_instance_id"], found["compute_instance_id"]) == (
        record.gpu_instance_id,
        record.compute_instance_id,
    )
    assert found["gpu"] == [g.uuid for g in GPUS].index(record.gpu_uuid)
    return found


async def held_to_its_instance(
    runtime_stack: RuntimeStack, pod: str, log: WorkloadLog, record: MigAllocation
) -> None:
    """The pod's process was handed the instance by its MIG UUID and sees it alone, at the
    instance's size (the slot's memory is the profile's), refused past it."""
    ((slot,),) = allocated_slots(await runtime_stack.stack.pod(pod))
    assert slot.uuid == record.gpu_uuid  # the device list names the GPU the instance is on
    instance = instance_of(await mig_instances(runtime_stack.stack.plugin), record)
    assert instance["memory_mib"] == slot.usedmem
    env = await runtime_stack.env(pod)
    assert env["NVIDIA_VISIBLE_DEVICES"] == record.mig_uuid
    assert log.one("driver")["devices"] == 1
    device, alloc = log.one("device", index=0), log.one("alloc", index=0)
    assert f"MIG {record.profile}" in str(device["name"])
    assert device["total"] == slot.usedmem * MiB
    assert alloc["refused_with"] == OUT_OF_MEMORY, alloc
    assert 0 < int(str(alloc["granted"])) <= slot.usedmem * MiB


async def instances_become(stack: GpuStack, want: set[str | None], what: str) -> list[MigInstance]:
    """The node's live MIG devices once their UUIDs are ``want``."""

    async def settled() -> tuple[list[MigInstance]] | None:
        found = await mig_instances(stack.plugin)
        return (found,) if {i["uuid"] for i in found} == want else None  # truthy even when empty

    done = await wait_for(settled, timeout=GONE_TIMEOUT_S, interval=0.5, what=what)
    assert done is not None
    return done[0]


async def test_mig_pods_run_in_instances_made_for_them_and_deleting_one_destroys_its_instance(
    runtime_stack: RuntimeStack,
) -> None:
    stack = runtime_stack.stack
    await create_mig_pod(stack, "small", 8000)
    small_log = await runtime_stack.ready("small")
    small = await record_of(stack, "small")
    # The smallest allowed profile covering 8000 MiB, from the GPU's first slice (2g fills upwards).
    assert (small.profile, small.placement) == ("2g.10gb", MigPlacement(start=0, size=2))
    await held_to_its_instance(runtime_stack, "small", small_log, small)

    # The monitor reports the instance under HAMi's metric, joinable with DCGM's by UUID and
    # GPU instance id.
    info = sample_key(
        "hami_mig_device_info",
        namespace=stack.namespace,
        pod="small",
        container="main",
        vdevice_index="0",
        device_uuid=small.gpu_uuid,
        mig_uuid=str(small.mig_uuid),
        profile=small.profile,
        gpu_instance_id=str(small.gpu_instance_id),
        compute_instance_id=str(small.compute_instance_id),
    )

    async def reported() -> float | None:
        return (await runtime_stack.metrics()).get(info)

    assert (
        await wait_for(reported, timeout=60, interval=0.5, what="the monitor to report the instance") == 1.0
    )

    # A second pod on the same GPU gets the smallest profile covering 16000 MiB, placed where
    # it overlaps nothing (3g fills downwards), in an instance of its own.
    await create_mig_pod(stack, "large", 16000, **{keys.USE_GPU_UUID: small.gpu_uuid})
    large_log = await runtime_stack.ready("large")
    large = await record_of(stack, "large")
    assert (large.gpu_uuid, large.profile, large.placement) == (
        small.gpu_uuid,
        "3g.20gb",
        MigPlacement(start=4, size=4),
    )
    await held_to_its_instance(runtime_stack, "large", large_log, large)
    assert large.mig_uuid != small.mig_uuid

    # Deleted, a pod's instance is destroyed; the other's stays.
    await stack.core.delete_namespaced_pod("small", stack.namespace, grace_period_seconds=0)
    await instances_become(stack, {large.mig_uuid}, "the deleted pod's instance to be destroyed")
    await stack.core.delete_namespaced_pod("large", stack.namespace, grace_period_seconds=0)
    await instances_become(stack, set(), "every instance to be destroyed")


async def test_a_killed_device_plugin_keeps_the_live_instance_and_destroys_what_no_pod_holds(
    runtime_stack: RuntimeStack,
) -> None:
    stack = runtime_stack.stack
    await create_mig_pod(stack, "kept", 8000)
    await runtime_stack.ready("kept")
    kept = await record_of(stack, "kept")
    other_gpu = 1 - [g.uuid for g in GPUS].index(kept.gpu_uuid)

    # A crash between making an instance and recording it leaves one that no pod names.
    await stack.plugin.kill()
    await make_instance(stack.plugin, other_gpu, slices=1)
    assert len(await mig_instances(stack.plugin)) == 2
    await stack.plugin.start(stack.kubelet_node)

    # Started again, the plugin adopts the pod's instance (same UUID and ids) and destroys the
    # leftover; the pod and its process never notice.
    (instance,) = await instances_become(stack, {kept.mig_uuid}, "the leftover instance to be destroyed")
    assert instance_of([instance], await record_of(stack, "kept")) == instance
    pod: dict[str, Any] = await stack.pod("kept")
    status = pod["status"]["containerStatuses"][0]
    assert (pod["status"]["phase"], status["restartCount"]) == ("Running", 0)
    again = await runtime_stack.exec("kept", "gpu-workload", "--exit", "--chunk-mib", "256")
    assert f"MIG {kept.profile}" in again, again

    # And still destroys it when the pod goes.
    await stack.core.delete_namespaced_pod("kept", stack.namespace, grace_period_seconds=0)
    await instances_become(stack, set(), "the adopted instance to be destroyed with its pod")
