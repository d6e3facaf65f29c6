"""Namespace GPU quotas on the real control plane: a ResourceQuota's
``limits.nvidia.com/gpumem`` is enforced per GPU by the extender, a pod over it stays Pending with
the quota, used and limit named until the quota frees, and the invariant holds throughout."""

from __future__ import annotations

from typing import Any

import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body

from hamipy.devcluster import API_TIMEOUT_S, wait_for
from hamipy.extender.server import ExtenderServer

pytestmark = pytest.mark.integration


async def limit_gpu_memory(cluster: Cluster, extender: ExtenderServer, mib: int) -> None:
    """A ResourceQuota ``gpu`` limiting the namespace's GPU memory, once the extender has it."""
    body = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpu"},
        "spec": {"hard": {"limits.nvidia.com/gpumem": str(mib)}},
    }
    core: Any = cluster.core
    await core.create_namespaced_resource_quota(cluster.namespace, body, _request_timeout=API_TIMEOUT_S)
    await wait_for(
        lambda: bool(extender.model.quotas.limits(cluster.namespace)),
        timeout=30,
        what="the extender sees the quota",
    )


def quota_used(extender: ExtenderServer, namespace: str) -> float | None:
    labels = {"namespace": namespace, "quota_name": "nvidia.com/gpumem", "limit": "16384"}
    return extender.telemetry.metrics.registry.get_sample_value("hami_resource_quota_used", labels)


async def test_a_quota_admits_two_8gib_pods_and_holds_the_third_until_one_goes(
    cluster: Cluster, extender: ExtenderServer
) -> None:
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-{i}", i, mem=40000) for i in range(2)])
    await limit_gpu_memory(cluster, extender, 16384)
    for name in ("a", "b"):
        await cluster.create(pod_body(name, container(gpu=1, gpumem=8192), selector=ns))
        await cluster.bound(name)
    await cluster.create(pod_body("c", container(gpu=1, gpumem=8192), selector=ns))
    message = await cluster.unschedulable("c", "ResourceQuotaNotFit")
    assert f"quota {ns}/gpu: limits.nvidia.com/gpumem is 16384, 16384 used, the pod asks 8192" in message
    assert quota_used(extender, ns) == 16384
    await cluster.core.delete_namespaced_pod("a", ns, grace_period_seconds=0, _request_timeout=API_TIMEOUT_S)
    await cluster.bound("c", timeout=60)
    assert quota_used(extender, ns) == 16384
    await cluster.assert_invariant()


async def test_a_two_gpu_pod_is_charged_for_both(cluster: Cluster, extender: ExtenderServer) -> None:
    """Kubernetes would count ``gpumem: 4096`` once; the pod holds 4096 MiB on each of two GPUs."""
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-{i}", i, mem=40000) for i in range(4)])
    await limit_gpu_memory(cluster, extender, 16384)
    for name in ("a", "b"):
        await cluster.create(pod_body(name, container(gpu=2, gpumem=4096), selector=ns))
        _, slots = await cluster.bound(name)
        assert len(slots[0]) == 2
    assert quota_used(extender, ns) == 16384
    await cluster.create(pod_body("c", container(gpu=1, gpumem=1024), selector=ns))
    message = await cluster.unschedulable("c", "ResourceQuotaNotFit")
    assert "16384 used, the pod asks 1024" in message
    await cluster.assert_invariant()


def nudges_sent(extender: ExtenderServer) -> float:
    value = extender.telemetry.metrics.registry.get_sample_value(
        "hamipy_extender_requeue_nudges_total", {"result": "sent"}
    )
    return value or 0.0


async def test_a_pod_held_by_its_quota_is_placed_once_the_quota_is_raised(
    cluster: Cluster, extender: ExtenderServer
) -> None:
    """kube-scheduler does not watch ResourceQuotas, so nothing it sees changes when the limit is
    raised: the extender's requeue nudge makes it retry the pod (else it waits for the 5-minute
    flush of kube-scheduler's unschedulable pool)."""
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-{i}", i, mem=40000) for i in range(2)])
    await limit_gpu_memory(cluster, extender, 8192)
    await cluster.create(pod_body("a", container(gpu=1, gpumem=8192), selector=ns))
    await cluster.bound("a")
    await cluster.create(pod_body("b", container(gpu=1, gpumem=8192), selector=ns))
    await cluster.unschedulable("b", "ResourceQuotaNotFit")
    sent = nudges_sent(extender)
    raised = {"spec": {"hard": {"limits.nvidia.com/gpumem": "16384"}}}
    core: Any = cluster.core
    await core.patch_namespaced_resource_quota("gpu", ns, raised, _request_timeout=API_TIMEOUT_S)
    await cluster.bound("b", timeout=30)
    assert nudges_sent(extender) > sent
    await cluster.assert_invariant()
