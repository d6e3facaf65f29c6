"""What a real kubelet adds to a GPU pod's life: a Deployment scaled down and up again,
a native sidecar holding a GPU beside its app, a deletion that frees the GPU only once the kubelet
has stopped the containers, on the same stack as the whole-path tests (``stack_support``: the real
kubelet v1.34 over the fake runtime, the device plugin process, the webhook and one extender)."""

from __future__ import annotations

import asyncio
from typing import Any

import builders
import pytest
from builders import container
from stack_support import NEEDS_REAL_KUBELET, GpuStack, allocated_slots

from hamipy.devcluster import API_TIMEOUT_S, wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.extender.invariant import check_cluster
from hamipy.kube.client import MERGE_PATCH, RawKube

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPUS = (
    FakeGpu("GPU-dddddddd-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-80GB", 81920, numa=0),
    FakeGpu("GPU-dddddddd-0000-4000-8000-000000000001", "NVIDIA A100-SXM4-80GB", 81920, numa=1),
)


def held_on_node(stack: GpuStack) -> set[str]:
    """The pod UIDs the extender counts on the stack's node."""
    return {str(uid) for uid, c in stack.extender.model.contributions.items() if c.node == stack.node}


async def assert_invariant(stack: GpuStack) -> None:
    report = await check_cluster(RawKube(stack.api))
    assert report.ok, report.violations


# -- a Deployment scaled 3 -> 1 -> 3 ---------------------------------------------------------------

APPS = "/apis/apps/v1"


def deployment(stack: GpuStack, name: str, replicas: int) -> dict[str, Any]:
    spec = {
        "nodeSelector": {"gpu-test": stack.namespace},
        "terminationGracePeriodSeconds": 0,
        # Two fit on one 80 GB GPU: four on the node, so a leaked allocation shows as a replica
        # left Pending when the Deployment grows back to three.
        "containers": [container("main", gpu=1, gpumem=30000, gpucores=20)],
    }
    return builders.deployment(name, replicas, spec)


async def settled(stack: GpuStack, app: str, replicas: int) -> list[dict[str, Any]]:
    """The Deployment's pods once exactly `replicas` exist, each Running and served, and no other."""
    kube = RawKube(stack.api)

    async def done() -> list[dict[str, Any]] | None:
        listed = await kube.request(
            "GET", f"/api/v1/namespaces/{stack.namespace}/pods", query=[("labelSelector", f"app={app}")]
        )
        pods: list[dict[str, Any]] = listed["items"]
        ready = [
            p
            for p in pods
            if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
            and (p["metadata"].get("annotations") or {}).get("hami.io/bind-phase") == "success"
        ]
        return pods if len(pods) == replicas == len(ready) else None

    found: list[dict[str, Any]] | None = await wait_for(
        done, timeout=120, interval=0.2, what=f"deployment {app} settled at {replicas} running replicas"
    )
    assert found is not None
    return found


async def test_a_gpu_deployment_scaled_down_and_up_neither_overallocates_nor_leaks(
    gpu_stack: GpuStack,
) -> None:
    kube = RawKube(gpu_stack.api)
    base = f"{APPS}/namespaces/{gpu_stack.namespace}/deployments"
    await kube.request("POST", base, body=deployment(gpu_stack, "train", 3))
    seen: set[str] = set()
    for step, replicas in enumerate((3, 1, 3)):
        if step:
            await kube.request(
                "PATCH",
                f"{base}/train/scale",
                body={"spec": {"replicas": replicas}},
                content_type=MERGE_PATCH,
            )
        pods = await settled(gpu_stack, "train", replicas)
        live = {p["metadata"]["uid"] for p in pods}
        seen |= live

        # What the extender counts on the node is exactly the live replicas: nothing leaked by the
        # pods the kubelet stopped and deleted.
        def counted_exactly(live: set[str] = live) -> bool:
            return held_on_node(gpu_stack) == live

        await wait_for(
            counted_exactly,
            timeout=30,
            interval=0.1,
            what=f"the extender to count exactly the {replicas} live replicas",
        )
        await assert_invariant(gpu_stack)
        for pod in pods:
            (slot,) = allocated_slots(pod)
            config = await gpu_stack.container(pod["metadata"]["name"], "main")
            assert config.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "30000m"
            assert config.envs["NVIDIA_VISIBLE_DEVICES"] == slot[0].uuid
        per_gpu = [sum(1 for p in pods if allocated_slots(p)[0][0].uuid == g.uuid) for g in GPUS]
        assert max(per_gpu) <= 2, f"more than two 30000 MiB replicas on one GPU: {per_gpu}"
    assert len(seen) == 5, "scaling down deleted two replicas, scaling up made two new ones"


async def test_a_native_sidecar_with_a_gpu_runs_beside_its_app(gpu_stack: GpuStack) -> None:
    # An init container with restartPolicy Always starts first and keeps running with the app.
    body = gpu_stack.pod_body(
        "sidecar",
        [container("app", gpu=1, gpumem=20000, gpucores=30)],
        init=[container("proxy", gpu=1, gpumem=10000, gpucores=10, restartPolicy="Always")],
    )
    await gpu_stack.create(body)
    pod = await gpu_stack.served("sidecar")
    proxy_slot, app_slot = allocated_slots(pod)
    assert [(d.usedmem, d.usedcores) for d in proxy_slot] == [(10000, 10)]
    assert [(d.usedmem, d.usedcores) for d in app_slot] == [(20000, 30)]
    for name, slot in (("proxy", proxy_slot), ("app", app_slot)):
        config = await gpu_stack.container("sidecar", name)
        assert config.envs["NVIDIA_VISIBLE_DEVICES"] == slot[0].uuid
        assert config.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{slot[0].usedmem}m"
        assert config.envs["CUDA_DEVICE_SM_LIMIT"] == str(slot[0].usedcores)
    running = await gpu_stack.running("sidecar")
    assert running["status"]["initContainerStatuses"][0]["state"].get("running") is not None
    assert running["status"]["containerStatuses"][0]["state"].get("running") is not None
    await assert_invariant(gpu_stack)


# -- deletion frees the GPU only once the kubelet has stopped the containers ----------------------


async def unschedulable(stack: GpuStack, name: str) -> dict[str, Any]:
    """The pod once kube-scheduler has tried it and found no node (PodScheduled False)."""

    async def refused() -> dict[str, Any] | None:
        pod = await stack.pod(name)
        for cond in pod["status"].get("conditions") or []:
            if cond["type"] == "PodScheduled" and cond["status"] == "False":
                return pod
        return None

    found: dict[str, Any] | None = await wait_for(
        refused, timeout=60, interval=0.2, what=f"{name} unschedulable"
    )
    assert found is not None
    return found


async def test_a_deleted_pod_holds_its_gpus_until_the_kubelet_has_stopped_it(gpu_stack: GpuStack) -> None:
    kubelet = gpu_stack.kubelet_node.kubelet
    # 60000 MiB on each GPU: a 40000 MiB pod fits only once the holder is really gone.
    await gpu_stack.create(gpu_stack.pod_body("holder", [container("main", gpu=2, gpumem=60000)]))
    holder = await gpu_stack.served("holder")
    await gpu_stack.running("holder")
    uid = holder["metadata"]["uid"]
    # A node whose kubelet is down: the deletion is recorded, but no one stops the containers.
    await asyncio.to_thread(kubelet.stop_kubelet)
    await gpu_stack.core.delete_namespaced_pod(
        "holder", gpu_stack.namespace, grace_period_seconds=30, _request_timeout=API_TIMEOUT_S
    )
    deleting = await gpu_stack.pod("holder")
    assert deleting["metadata"].get("deletionTimestamp")
    await gpu_stack.create(gpu_stack.pod_body("next", [container("main", gpu=1, gpumem=40000)]))
    refused = await unschedulable(gpu_stack, "next")
    assert not refused["spec"].get("nodeName")
    assert uid in held_on_node(gpu_stack), "the holder's GPUs are still counted while it is being deleted"
    # The kubelet comes back, stops the containers, reports the pod finished and deletes it.
    await gpu_stack.kubelet_node.restart_kubelet()

    async def holder_gone() -> bool:
        try:
            await gpu_stack.pod("holder")
        except Exception as exc:  # kubernetes_asyncio's ApiException: 404 once deleted
            return getattr(exc, "status", None) == 404
        return False

    await wait_for(holder_gone, timeout=90, interval=0.2, what="the kubelet to finish deleting the holder")
    assert uid not in held_on_node(gpu_stack)
    placed = await gpu_stack.served("next", timeout=90)
    (slot,) = allocated_slots(placed)
    assert [d.usedmem for d in slot] == [40000]
    await assert_invariant(gpu_stack)
