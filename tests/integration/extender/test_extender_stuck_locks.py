"""A node lock nobody will release, on the real API server: a pod holding the
lock of one of two nodes for longer than a bind waits keeps no pod waiting. The filter passes that
node over, a bind sent there anyway is refused at once, and once the holder is gone the lock sweep
frees the node, which takes pods again. The nodes are served by HAMi's device plugin (no marker of
ours), so binds take the locked path; the pods name a scheduler of their own, so no kube-scheduler
binds them meanwhile."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import builders
import pytest
from builders import container, gpu
from stack_support import EXTENDER_SETTINGS, start_extenders

from hamipy.devcluster import NodePool, NodeSpec, wait_for
from hamipy.extender.invariant import check_cluster
from hamipy.extender.server import ExtenderServer
from hamipy.kube.client import RawKube
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.identifiers import NodeName
from hamipy.protocol.node_devices import encode_node_devices
from hamipy.protocol.node_lock import NodeLock, format_node_lock

pytestmark = pytest.mark.integration

SETTINGS = dataclasses.replace(EXTENDER_SETTINGS, bind_timeout_s=3.0, lock_sweep_interval_s=0.5)


@pytest.fixture
async def extender(kube_client: Any, namespace: str) -> AsyncIterator[ExtenderServer]:
    (server,) = await start_extenders(kube_client, 1, SETTINGS, Config(scheduler_name=f"stuck-{namespace}"))
    yield server
    await server.stop()


async def post(server: ExtenderServer, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(f"{server.url}/{verb}", json=body) as resp,
    ):
        assert resp.status == 200
        answer: dict[str, Any] = await resp.json()
        return answer


async def create_pod(kube: RawKube, namespace: str, name: str) -> dict[str, Any]:
    body = builders.pod(
        name,
        container(gpu=1, gpumem=1000),
        scheduler_name=f"stuck-{namespace}",
        terminationGracePeriodSeconds=0,
    )
    created: dict[str, Any] = await kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
    return created


def metric(server: ExtenderServer, name: str, labels: dict[str, str] | None = None) -> float:
    value = server.telemetry.metrics.registry.get_sample_value(name, labels or {})
    return value or 0.0


async def test_a_stuck_lock_keeps_no_pod_waiting_and_is_freed_once_its_holder_is_gone(
    kube_client: Any, namespace: str, node_pool: NodePool, extender: ExtenderServer
) -> None:
    kube = RawKube(kube_client)
    stuck, free = f"{namespace}-stuck", f"{namespace}-free"
    for i, name in enumerate((stuck, free)):
        await node_pool.add(
            NodeSpec(
                name=name,
                annotations={keys.NODE_REGISTER: encode_node_devices([gpu(f"GPU-{namespace}-{i}")])},
                capacity={keys.RESOURCE_COUNT: "10"},
            )
        )
    # The holder's bind died before it released the lock (HAMi's scheduler crashed, say); it is
    # still pending, so nothing breaks the lock before it expires in 5 minutes.
    await create_pod(kube, namespace, "holder")
    taken = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=SETTINGS.bind_timeout_s + 5)
    lock = format_node_lock(NodeLock(taken, namespace, "holder"))
    await kube.request(
        "PATCH",
        f"/api/v1/nodes/{stuck}",
        body={"metadata": {"annotations": {keys.NODE_LOCK: lock}}},
        content_type="application/merge-patch+json",
    )
    p = await create_pod(kube, namespace, "p")

    async def seen() -> bool:
        state = extender.model.nodes.get(NodeName(stuck))
        pending = p["metadata"]["uid"] in extender.model.pending
        return state is not None and state.lock_value == lock and pending

    await wait_for(seen, timeout=10, interval=0.05, what="the lock and the pod in the extender's model")

    # Binpack would prefer neither; the filter must not offer the stuck node at all.
    answer = await post(extender, "filter", {"Pod": p, "NodeNames": [stuck]})
    assert answer["NodeNames"] == []
    assert f"node lock held by {namespace}/holder" in answer["FailedNodes"][stuck]
    answer = await post(extender, "filter", {"Pod": p, "NodeNames": [stuck, free]})
    assert answer["NodeNames"] == [free]

    # A bind chosen there before is refused at once: no wait for a lock that will not move.
    meta = p["metadata"]
    args = {"PodName": "p", "PodNamespace": namespace, "PodUID": meta["uid"], "Node": stuck}
    answer = await post(extender, "bind", args)
    assert f"has been locked by {namespace}/holder since" in answer["Error"]
    assert metric(extender, "hamipy_extender_lock_waits_total") == 0

    # The holder goes: the sweep frees the node (the holder left it nothing to release).
    holder_path = f"/api/v1/namespaces/{namespace}/pods/holder"
    await kube.request("DELETE", holder_path, query=[("gracePeriodSeconds", "0")])

    async def freed() -> bool:
        node: dict[str, Any] = await kube.request("GET", f"/api/v1/nodes/{stuck}")
        return keys.NODE_LOCK not in (node["metadata"].get("annotations") or {})

    await wait_for(freed, timeout=15, interval=0.1, what=f"the lock on {stuck} freed by the sweep")
    assert metric(extender, "hamipy_extender_lock_breaks_total", {"reason": "owner-gone"}) == 1

    answer = await post(extender, "bind", args)
    assert answer["Error"] == ""
    bound: dict[str, Any] = await kube.request("GET", f"/api/v1/namespaces/{namespace}/pods/p")
    assert bound["spec"]["nodeName"] == stuck
    report = await check_cluster(kube)
    assert report.ok, report.violations
