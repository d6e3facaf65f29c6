"""The real kube-scheduler binds pods to simulated nodes, by itself and through an extender."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest
from aiohttp import web
from builders import container, pod
from kubernetes_asyncio.client import CoordinationV1Api, CoreV1Api

from hamipy.devcluster import (
    API_TIMEOUT_S,
    ExtenderConfig,
    ManagedResource,
    NodePool,
    NodeSpec,
    wait_for,
    wait_pod_bound,
)

pytestmark = pytest.mark.integration

GPU = "nvidia.com/gpu"


async def test_simulated_node_is_ready_untainted_and_leased(
    kube_client: Any, namespace: str, node_pool: NodePool
) -> None:
    node = await node_pool.add(
        NodeSpec(
            name=f"{namespace}-n0",
            labels={"zone": "a"},
            capacity={GPU: "4"},
            annotations={"example.com/note": "hi"},
        )
    )
    got = await CoreV1Api(kube_client).read_node(node.name, _request_timeout=API_TIMEOUT_S)
    ready = {c.type: c.status for c in got.status.conditions}
    assert ready["Ready"] == "True"
    assert not [t for t in (got.spec.taints or []) if t.key == "node.kubernetes.io/not-ready"]
    assert got.status.allocatable[GPU] == "4"
    assert got.metadata.labels["zone"] == "a"
    assert got.metadata.annotations["example.com/note"] == "hi"
    lease = await CoordinationV1Api(kube_client).read_namespaced_lease(
        node.name, "kube-node-lease", _request_timeout=API_TIMEOUT_S
    )
    assert lease.spec.holder_identity == node.name


async def test_default_scheduler_binds_pod_to_simulated_node(
    kube_client: Any, namespace: str, node_pool: NodePool
) -> None:
    names = {
        (await node_pool.add(NodeSpec(name=f"{namespace}-n{i}", labels={"devcluster-test": namespace}))).name
        for i in range(2)
    }
    core: Any = CoreV1Api(kube_client)  # its hint asks for a V1Pod; the client sends a JSON body as it is
    await core.create_namespaced_pod(
        namespace,
        pod(
            "plain",
            container(),
            scheduler_name="default-scheduler",
            nodeSelector={"devcluster-test": namespace},
        ),
        _request_timeout=API_TIMEOUT_S,
    )

    node = await wait_pod_bound(kube_client, namespace, "plain", timeout=30)

    assert node in names


@dataclasses.dataclass
class ExtenderStub:
    """A scheduler extender in the test: records the JSON it gets; /bind binds to `target`."""

    url: str
    target: str = ""
    filters: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    binds: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def extender_stub(kube_client: Any) -> AsyncIterator[ExtenderStub]:
    port = _free_port()
    stub = ExtenderStub(url=f"http://127.0.0.1:{port}")
    core = CoreV1Api(kube_client)

    async def filter_(request: web.Request) -> web.Response:
        args = await request.json()
        stub.filters.append(args)
        names = args["NodeNames"] or []
        return web.json_response(
            {
                "NodeNames": [n for n in names if n == stub.target],
                "FailedNodes": {n: "not the test's target" for n in names if n != stub.target},
                "Error": "",
            }
        )

    async def bind(request: web.Request) -> web.Response:
        args = await request.json()
        stub.binds.append(args)
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args["PodName"], "namespace": args["PodNamespace"], "uid": args["PodUID"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args["Node"]},
        }
        # The Binding response is a Status, which the generated client cannot decode as a Binding.
        resp: Any = await core.create_namespaced_pod_binding(
            args["PodName"],
            args["PodNamespace"],
            cast("Any", body),
            _preload_content=False,
            _request_timeout=API_TIMEOUT_S,
        )
        resp.release()
        return web.json_response({"Error": ""})

    app = web.Application()
    app.router.add_post("/filter", filter_)
    app.router.add_post("/bind", bind)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield stub
    finally:
        await runner.cleanup()


async def test_hami_scheduler_calls_extender_filter_and_bind(
    kube_client: Any,
    namespace: str,
    node_pool: NodePool,
    extender_stub: ExtenderStub,
    hami_scheduler: Callable[..., Any],
) -> None:
    names = [
        (await node_pool.add(NodeSpec(name=f"{namespace}-gpu{i}", capacity={GPU: "4"}))).name
        for i in range(3)
    ]
    extender_stub.target = names[1]
    hami_scheduler(
        ExtenderConfig(
            url_prefix=extender_stub.url,
            filter_verb="filter",
            bind_verb="bind",
            node_cache_capable=True,
            managed_resources=(ManagedResource(GPU, ignored_by_scheduler=True),),
            http_timeout_s=5,
        )
    )
    core: Any = CoreV1Api(kube_client)  # its hint asks for a V1Pod; the client sends a JSON body as it is
    created = await core.create_namespaced_pod(
        namespace,
        pod("gpu-pod", container(limits={GPU: "1"}), scheduler_name="hami-scheduler"),
        _request_timeout=API_TIMEOUT_S,
    )

    node = await wait_pod_bound(kube_client, namespace, "gpu-pod", timeout=30)

    assert node == names[1]
    await wait_for(lambda: extender_stub.binds, timeout=5, what="the extender's /bind to be recorded")
    first = extender_stub.filters[0]
    assert first["Pod"]["metadata"]["name"] == "gpu-pod"
    assert first["Pod"]["metadata"]["uid"] == created.metadata.uid
    assert first["Pod"]["spec"]["containers"][0]["resources"]["limits"] == {GPU: "1"}
    assert set(names) <= set(first["NodeNames"])
    assert first.get("Nodes") is None
    assert extender_stub.binds == [
        {"PodName": "gpu-pod", "PodNamespace": namespace, "PodUID": created.metadata.uid, "Node": names[1]}
    ]
