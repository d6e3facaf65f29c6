"""Static MIG on the real control plane and real containers: a node whose device plugin runs
``migstrategy: mixed`` registers each instance made beforehand as a device of its own beside its
GPUs shared as usual, and serves a MIG pod and a shared pod side by side.

GPU 0 of the fake driver starts in MIG mode, split into a 3g.40gb and a 2g.20gb instance (the
``mig_instances`` the driver makes with its state); GPU 1 is an ordinary H100.
"""

from __future__ import annotations

import pytest
from mig_support import mig_instances
from runtime_support import NEEDS_REAL_KUBELET, MiB, RuntimeStack, sees_only, workload
from stack_support import allocated_slots

from hamipy.devcluster import wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.protocol import keys
from hamipy.protocol.node_devices import decode_node_devices

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

SPLIT = FakeGpu(
    "GPU-51a71c00-0000-4000-8000-000000000000",
    "NVIDIA H100 80GB HBM3",
    81559,
    mig_instances="3g.40gb@4,2g.20gb@0",
)
SHARED = FakeGpu("GPU-51a71c00-0000-4000-8000-000000000001", "NVIDIA H100 80GB HBM3", 81559)
GPUS = (SPLIT, SHARED)
NODE_CONFIG = {"migstrategy": "mixed"}


async def test_a_mixed_node_serves_whole_instances_to_mig_pods_beside_shared_slices(
    runtime_stack: RuntimeStack,
) -> None:
    stack = runtime_stack.stack
    instances = {i["name"].rsplit(" ", 1)[-1]: i for i in await mig_instances(stack.plugin)}
    assert sorted(instances) == ["2g.20gb", "3g.40gb"]

    # Registered: each instance a device of its own (mode mig, exclusive, its own memory), and
    # the GPU that is not split, shared as usual.
    node = await stack.core.read_node(stack.node)
    devices = {d.id: d for d in decode_node_devices(node.metadata.annotations[keys.NODE_REGISTER])}
    assert set(devices) == {instances["3g.40gb"]["uuid"], instances["2g.20gb"]["uuid"], SHARED.uuid}
    for instance in instances.values():
        registered = devices[instance["uuid"]]
        assert (registered.mode, registered.count, registered.devmem) == ("mig", 1, instance["memory_mib"])
    assert devices[SHARED.uuid].mode == "hami-core"
    assert devices[SHARED.uuid].count > 1

    # A MIG pod whose memory only the 3g.40gb instance covers gets that instance, whole and alone.
    body = stack.pod_body("mig", [workload(gpu=1, gpumem=30000)])
    body["metadata"]["annotations"] = {keys.VGPU_MODE: "mig"}
    await stack.create(body)
    # A pod that does not ask for MIG shares the other GPU, on the same node at the same time.
    await stack.create(stack.pod_body("shared", [workload(gpu=1, gpumem=4000, gpucores=30)]))
    mig_log, shared_log = await runtime_stack.ready("mig"), await runtime_stack.ready("shared")

    ((mig_slot,),) = allocated_slots(await stack.pod("mig"))
    assert mig_slot.uuid == instances["3g.40gb"]["uuid"]
    assert (await runtime_stack.env("mig"))["NVIDIA_VISIBLE_DEVICES"] == mig_slot.uuid
    assert "MIG 3g.40gb" in str(mig_log.one("device", index=0)["name"])
    assert mig_log.one("device", index=0)["total"] == mig_slot.usedmem * MiB
    ((shared_slot,),) = allocated_slots(await stack.pod("shared"))
    assert shared_slot.uuid == SHARED.uuid
    sees_only(shared_log, [SHARED.uuid], 4000)

    # The instance is the pod's alone: a second MIG pod that only it could hold waits.
    body = stack.pod_body("waits", [workload(gpu=1, gpumem=30000)])
    body["metadata"]["annotations"] = {keys.VGPU_MODE: "mig"}
    await stack.create(body)

    async def unschedulable() -> str | None:
        conditions = (await stack.pod("waits"))["status"].get("conditions") or ()
        found = [c for c in conditions if c.get("reason") == "Unschedulable"]
        return str(found[0].get("message")) if found else None

    message = await wait_for(unschedulable, timeout=60, interval=0.5, what="the second MIG pod to wait")
    assert message is not None
    assert (await stack.pod("waits"))["spec"].get("nodeName") is None
