"""Register entries the extender refuses, on the real control plane and kube-scheduler: a node whose
device plugin registers another node's GPU UUID, and one registering a GPU with 0 MiB. The GPU is
offered through one node only (the one whose Node is older), the refusals are Events on the nodes,
and when the owning node goes, the other node's entry takes the pods that waited."""

from __future__ import annotations

import builders
import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body

from hamipy.devcluster import API_TIMEOUT_S, NodeSpec, wait_for
from hamipy.extender.server import ExtenderServer
from hamipy.protocol import keys

pytestmark = pytest.mark.integration

PODS = 4
"""Each asks one GPU and 1000 MiB: the shared GPU (2 slots, 2000 MiB) takes two."""


async def refusal_events(cluster: Cluster, node: str) -> list[str]:
    """The messages of the ``GPURefused`` Events on ``node`` (a Node's Events are in ``default``)."""
    events = await cluster.core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={node}", _request_timeout=API_TIMEOUT_S
    )
    return [str(e.message) for e in events.items if e.reason == "GPURefused"]


async def placed(cluster: Cluster) -> dict[str, str]:
    """The test's pods bound so far: name -> node."""
    pods = await cluster.core.list_namespaced_pod(cluster.namespace, _request_timeout=API_TIMEOUT_S)
    return {p.metadata.name: p.spec.node_name for p in pods.items if p.spec.node_name}


async def refusal(cluster: Cluster, name: str) -> str:
    """kube-scheduler's message on the pod's ``PodScheduled=False`` condition ("" if none)."""
    pod = await cluster.core.read_namespaced_pod(name, cluster.namespace, _request_timeout=API_TIMEOUT_S)
    for cond in pod.status.conditions or ():
        if cond.type == "PodScheduled" and cond.status == "False":
            return str(cond.message or "")
    return ""


async def test_a_gpu_two_nodes_register_is_booked_once_and_moves_when_its_owner_goes(
    cluster: Cluster, extender: ExtenderServer
) -> None:
    ns = cluster.namespace
    shared = f"GPU-{ns}-shared"
    # "a" is created first, and sorts first by name should both be created in one second.
    owner = await cluster.add_node("a", [gpu(shared, 0, count=2, mem=2000)])
    copy = await cluster.add_node("b", [gpu(shared, 0, count=2, mem=2000)])
    # A node of its own for the 0 MiB GPU: a pod asking a GPU and no memory (0 MiB of 0 fits) may
    # go only there.
    empty = f"{ns}-z"
    devices = [gpu(f"GPU-{ns}-empty", 0, count=2, mem=0)]
    await cluster.pool.add(
        NodeSpec(
            name=empty,
            labels={"extender-test": empty},
            annotations=builders.plugin_registration(devices),
            capacity={keys.RESOURCE_COUNT: "2"},
        )
    )
    await cluster.create(pod_body("whole", container(gpu=1), selector=empty))
    for i in range(PODS):
        await cluster.create(pod_body(f"p{i}", container(gpu=1, gpumem=1000), selector=ns))

    async def two_bound_two_refused() -> dict[str, str]:
        bound = {name: node for name, node in (await placed(cluster)).items() if name != "whole"}
        waiting = [f"p{i}" for i in range(PODS) if f"p{i}" not in bound]
        if len(bound) < 2 or not all(["CardRefused" in await refusal(cluster, n) for n in waiting]):
            return {}  # not yet
        return bound

    bound = await wait_for(two_bound_two_refused, timeout=60, what="two pods bound, two refused")
    await cluster.assert_invariant()  # one GPU through two nodes: the pods on both count against it
    assert set(bound.values()) == {owner}, bound
    assert "1/1 CardRefused" in await cluster.unschedulable("whole", "CardRefused")

    (message,) = await wait_for(lambda: refusal_events(cluster, copy), timeout=30, what="an Event on b")
    assert f"GPU {shared} (index 0) is not scheduled: node {owner} registers the same GPU UUID" in message
    (message,) = await wait_for(lambda: refusal_events(cluster, empty), timeout=30, what="an Event on z")
    assert "registered with 0 MiB" in message
    assert await refusal_events(cluster, owner) == []

    # The owner goes, and its pods with it (the pod garbage collector deletes pods of a node that is
    # gone): b's entry takes the pods that waited.
    await cluster.pool.remove(owner)
    for name in bound:
        await cluster.core.delete_namespaced_pod(
            name, ns, grace_period_seconds=0, _request_timeout=API_TIMEOUT_S
        )

    async def moved() -> dict[str, str]:
        now = await placed(cluster)
        later = {name: node for name, node in now.items() if name not in bound and name != "whole"}
        return later if len(later) == PODS - 2 else {}

    later = await wait_for(moved, timeout=60, what="the waiting pods bound on b")
    assert set(later.values()) == {copy}
    await cluster.assert_invariant()
