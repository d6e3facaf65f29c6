"""Two binds of one pod at once against the real API server: as when
kube-scheduler retries a bind after its timeout while the first still runs, or a new leader binds
what the old one was binding. Two extender replicas get ``/bind`` for the same pod over HTTP, on one
node or on two; the API server's Binding carries the allocation and the pod's resourceVersion, so
the first write wins and the other changes nothing. The pods name a scheduler of their own, so no
kube-scheduler binds them meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import builders
import pytest
from builders import container, gpu
from stack_support import start_extenders

from hamipy.devcluster import API_TIMEOUT_S, NodePool, NodeSpec
from hamipy.extender.invariant import check_cluster
from hamipy.extender.server import ExtenderServer
from hamipy.kube.client import MERGE_PATCH, RawKube
from hamipy.kube.errors import Conflict
from hamipy.kube.resources import create_binding
from hamipy.protocol import decode_pod_devices, keys
from hamipy.protocol.config import Config
from hamipy.protocol.node_devices import encode_node_devices

pytestmark = pytest.mark.integration


@pytest.fixture
async def replicas(kube_client: Any, namespace: str) -> AsyncIterator[list[ExtenderServer]]:
    servers = await start_extenders(kube_client, 2, config=Config(scheduler_name=f"race-{namespace}"))
    yield servers
    for server in servers:
        await server.stop()


async def add_node(pool: NodePool, name: str, uuid: str) -> None:
    devices = [gpu(uuid)]
    await pool.add(
        NodeSpec(
            name=name,
            annotations={keys.NODE_REGISTER: encode_node_devices(devices)},
            capacity={keys.RESOURCE_COUNT: "10"},
        )
    )


async def bind(server: ExtenderServer, pod: dict[str, Any], node: str) -> str:
    """POST /bind as kube-scheduler does; the answer's Error ("" when bound)."""
    meta = pod["metadata"]
    args = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(f"{server.url}/bind", json=args) as resp,
    ):
        assert resp.status == 200
        error: str = (await resp.json())["Error"]
        return error


async def racing_pod(kube: RawKube, namespace: str) -> dict[str, Any]:
    body = builders.pod(
        "p",
        container(gpu=1, gpumem=1000),
        scheduler_name=f"race-{namespace}",
        terminationGracePeriodSeconds=0,
    )
    created: dict[str, Any] = await kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
    return created


async def assert_one_allocation(kube: RawKube, namespace: str) -> dict[str, Any]:
    pod: dict[str, Any] = await kube.request(
        "GET", f"/api/v1/namespaces/{namespace}/pods/p", timeout_s=API_TIMEOUT_S
    )
    annotations = pod["metadata"]["annotations"]
    assert annotations[keys.VGPU_NODE] == pod["spec"]["nodeName"]
    (slot,) = decode_pod_devices(annotations[keys.DEVICES_ALLOCATED])
    assert [d.usedmem for d in slot] == [1000]
    report = await check_cluster(kube)
    assert report.ok, report.violations
    return pod


async def test_two_binds_of_one_pod_on_one_node_bind_it_once(
    kube_client: Any, namespace: str, node_pool: NodePool, replicas: list[ExtenderServer]
) -> None:
    kube = RawKube(kube_client)
    node = f"{namespace}-n"
    await add_node(node_pool, node, f"GPU-{namespace}-0")
    pod = await racing_pod(kube, namespace)
    errors = await asyncio.gather(*(bind(server, pod, node) for server in replicas))
    # The second finds the pod bound where it was asked to bind it: done, not an error.
    assert errors == ["", ""]
    bound = await assert_one_allocation(kube, namespace)
    assert bound["spec"]["nodeName"] == node


async def test_two_binds_of_one_pod_on_two_nodes_bind_it_once_and_the_loser_leaves_it(
    kube_client: Any, namespace: str, node_pool: NodePool, replicas: list[ExtenderServer]
) -> None:
    kube = RawKube(kube_client)
    nodes = [f"{namespace}-a", f"{namespace}-b"]
    for i, node in enumerate(nodes):
        await add_node(node_pool, node, f"GPU-{namespace}-{i}")
    pod = await racing_pod(kube, namespace)
    errors = await asyncio.gather(
        *(bind(server, pod, node) for server, node in zip(replicas, nodes, strict=True))
    )
    bound = await assert_one_allocation(kube, namespace)
    winner = nodes.index(bound["spec"]["nodeName"])
    assert errors[winner] == ""
    loser = errors[1 - winner]
    # Either it read the pod after the winner bound it, or its Binding met the winner's write.
    assert f"bound to {nodes[winner]}" in loser, loser
    # HAMi's device plugin serves these nodes: the winner's lock waits for its Allocate; the
    # loser's is gone.
    locks = []
    for node in nodes:
        got: dict[str, Any] = await kube.request("GET", f"/api/v1/nodes/{node}")
        locks.append((got["metadata"].get("annotations") or {}).get(keys.NODE_LOCK, ""))
    assert locks[winner].endswith(f",{namespace},p")
    assert locks[1 - winner] == "", "the losing bind left its lock behind"


async def test_the_api_servers_binding_writes_annotations_and_honours_the_resource_version(
    kube_client: Any, namespace: str, node_pool: NodePool
) -> None:
    """What the bind rests on: one Binding sets spec.nodeName and the annotations together, and a
    Binding naming an older resourceVersion of the pod is refused and writes nothing."""
    kube = RawKube(kube_client)
    node = f"{namespace}-n"
    await add_node(node_pool, node, f"GPU-{namespace}-0")
    pod = await racing_pod(kube, namespace)
    path = f"/api/v1/namespaces/{namespace}/pods/p"
    await kube.request(
        "PATCH", path, body={"metadata": {"labels": {"moved": "on"}}}, content_type=MERGE_PATCH
    )
    meta = pod["metadata"]

    async def bind_at(version: str) -> None:
        await create_binding(
            kube, namespace, "p", meta["uid"], node, annotations={"a": "1"}, resource_version=version
        )

    with pytest.raises(Conflict):
        await bind_at(meta["resourceVersion"])
    untouched = await kube.request("GET", path)
    assert not untouched["spec"].get("nodeName")
    assert "a" not in (untouched["metadata"].get("annotations") or {})
    await bind_at(untouched["metadata"]["resourceVersion"])
    bound = await kube.request("GET", path)
    assert (bound["spec"]["nodeName"], bound["metadata"]["annotations"]["a"]) == (node, "1")
