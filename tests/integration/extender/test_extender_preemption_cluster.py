"""Preemption by fraction on the real control plane: a high-priority pod
that needs 40 GiB of a GPU whose memory low-priority slices fill evicts exactly enough of them, on
one GPU, and is placed there; a pod of equal priority never preempts; Events name who was preempted
for whom; the invariant holds throughout."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body

from hamipy.devcluster import API_TIMEOUT_S, wait_for
from hamipy.extender.server import ExtenderServer
from hamipy.kube.client import RawKube
from hamipy.kube.errors import NotFound

pytestmark = pytest.mark.integration

GIB = 1024
PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"


@pytest.fixture
async def priorities(cluster: Cluster) -> AsyncIterator[dict[str, str]]:
    """PriorityClasses ``low`` (100) and ``high`` (1000) for this test, by their names."""
    kube = RawKube(cluster.api)
    names = {level: f"{cluster.namespace}-{level}" for level in ("low", "high")}
    for level, value in (("low", 100), ("high", 1000)):
        body = {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": names[level]},
            "value": value,
        }
        await kube.request("POST", PRIORITY_CLASSES, body=body)
    yield names
    for name in names.values():
        with contextlib.suppress(NotFound):
            await kube.request("DELETE", f"{PRIORITY_CLASSES}/{name}")


def slice_pod(cluster: Cluster, name: str, mib: int, priority_class: str) -> dict[str, Any]:
    body = pod_body(name, container(gpu=1, gpumem=mib), selector=cluster.namespace)
    body["spec"]["priorityClassName"] = priority_class
    return body


async def pod_names(cluster: Cluster) -> set[str]:
    pods = await cluster.core.list_namespaced_pod(cluster.namespace, _request_timeout=API_TIMEOUT_S)
    return {p.metadata.name for p in pods.items}


async def event_messages(cluster: Cluster, reason: str) -> list[str]:
    events = await cluster.core.list_namespaced_event(cluster.namespace, _request_timeout=API_TIMEOUT_S)
    return [str(e.message) for e in events.items if e.reason == reason]


async def test_a_high_priority_pod_evicts_exactly_enough_slices_on_one_gpu(
    cluster: Cluster, extender: ExtenderServer, priorities: dict[str, str]
) -> None:
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-{i}", i, mem=80 * GIB) for i in range(2)])
    placed: dict[str, str] = {}
    for i in range(8):
        await cluster.create(slice_pod(cluster, f"low-{i}", 20 * GIB, priorities["low"]))
        _, slots = await cluster.bound(f"low-{i}")
        placed[f"low-{i}"] = slots[0][0]
    assert sorted(placed.values()).count(f"GPU-{ns}-0") == 4  # both GPUs full

    await cluster.create(slice_pod(cluster, "high", 40 * GIB, priorities["high"]))
    _, slots = await cluster.bound("high", timeout=90)
    left = await pod_names(cluster)
    evicted = sorted(set(placed) - left)
    assert len(evicted) == 2, evicted
    (freed,) = {placed[name] for name in evicted}  # both from the GPU the pod now has
    assert slots == [[freed]]
    await cluster.assert_invariant()

    preempted = await wait_for(
        lambda: event_messages(cluster, "Preempted"), timeout=30, what="the victims' Preempted events"
    )
    assert all(f"Preempted by pod {ns}/high (priority 1000)" in m for m in preempted)
    (preempting,) = await wait_for(
        lambda: event_messages(cluster, "Preempting"), timeout=30, what="the preemptor's event"
    )
    assert all(f"{ns}/{name}" in preempting for name in evicted)


async def test_equal_priority_never_preempts(
    cluster: Cluster, extender: ExtenderServer, priorities: dict[str, str]
) -> None:
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-0", 0, mem=80 * GIB)])
    for i in range(2):
        await cluster.create(slice_pod(cluster, f"first-{i}", 40 * GIB, priorities["low"]))
        await cluster.bound(f"first-{i}")
    await cluster.create(slice_pod(cluster, "peer", 40 * GIB, priorities["low"]))
    message = await cluster.unschedulable("peer", "CardInsufficientMemory")
    assert "Preempting" not in message
    assert await pod_names(cluster) == {"first-0", "first-1", "peer"}
    assert extender.model.nominations == {}
    await cluster.assert_invariant()
