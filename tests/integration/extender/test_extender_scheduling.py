"""The extender with the real kube-scheduler and apiserver.

The extender runs in this process (aiohttp on a loopback port) with its real watch and bind against
the devcluster; the ``hami-scheduler`` kube-scheduler calls it for /filter and /bind. Simulated
nodes carry a ``hami.io/node-nvidia-register`` annotation written here (no device plugin runs in
these tests) and ``nvidia.com/gpu`` capacity. Every test ends with the invariant checked against the API.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import builders
import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body, round_robin_proxy
from stack_support import EXTENDER_SETTINGS, elected, start_extenders, use_extender

from hamipy.devcluster import (
    API_TIMEOUT_S,
    wait_for,
)
from hamipy.devcluster.kubeobjects import create_namespace, delete_namespace
from hamipy.extender.server import ExtenderServer
from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.node_devices import encode_node_devices
from hamipy.protocol.node_lock import NodeLock, format_node_lock
from hamipy.protocol.pod_devices import encode_pod_devices

pytestmark = pytest.mark.integration

SETTINGS = EXTENDER_SETTINGS


# -- policies ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["binpack", "spread"])
async def test_node_policy_over_three_nodes(cluster: Cluster, extender: ExtenderServer, policy: str) -> None:
    for i in range(3):
        await cluster.add_node(f"n{i}", [gpu(f"GPU-{cluster.namespace}-{i}")])
    nodes = []
    for i in range(3):
        ann = {keys.NODE_SCHEDULER_POLICY: policy}
        await cluster.create(
            pod_body(f"p{i}", container(gpu=1, gpumem=1000), selector=cluster.namespace, annotations=ann)
        )
        nodes.append((await cluster.bound(f"p{i}"))[0])
    assert len(set(nodes)) == (1 if policy == "binpack" else 3)
    await cluster.assert_invariant()


@pytest.mark.parametrize("policy", ["binpack", "spread"])
async def test_gpu_policy_on_one_node(cluster: Cluster, extender: ExtenderServer, policy: str) -> None:
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-{i}", i) for i in range(4)])
    used = []
    for i in range(3):
        ann = {keys.GPU_SCHEDULER_POLICY: policy}
        await cluster.create(pod_body(f"p{i}", container(gpu=1, gpumem=1000), selector=ns, annotations=ann))
        used.append((await cluster.bound(f"p{i}"))[1][0][0])
    assert len(set(used)) == (1 if policy == "binpack" else 3)


# -- selectors and asks ------------------------------------------------------------------------------


async def test_type_and_uuid_selectors(cluster: Cluster, extender: ExtenderServer) -> None:
    ns = cluster.namespace
    await cluster.add_node(
        "n", [gpu(f"GPU-{ns}-a", 0, type_="NVIDIA-A100"), gpu(f"GPU-{ns}-t", 1, type_="NVIDIA-T4")]
    )
    await cluster.create(
        pod_body("by-type", container(gpu=1, gpumem=100), selector=ns, annotations={keys.USE_GPU_TYPE: "t4"})
    )
    await cluster.create(
        pod_body(
            "by-uuid",
            container(gpu=1, gpumem=100),
            selector=ns,
            annotations={keys.USE_GPU_UUID: f"GPU-{ns}-a"},
        )
    )
    assert (await cluster.bound("by-type"))[1] == [[f"GPU-{ns}-t"]]
    assert (await cluster.bound("by-uuid"))[1] == [[f"GPU-{ns}-a"]]


async def test_exclusive_cores_and_memory_percentage(cluster: Cluster, extender: ExtenderServer) -> None:
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-0", 0, mem=10000), gpu(f"GPU-{ns}-1", 1, mem=10000)])
    await cluster.create(pod_body("whole", container(gpu=1, gpumem=1000, gpucores=100), selector=ns))
    await cluster.create(pod_body("pct", container(gpu=1, gpumem_percentage=40), selector=ns))
    whole = (await cluster.bound("whole"))[1][0][0]
    pct = (await cluster.bound("pct"))[1][0][0]
    assert whole != pct  # the exclusive pod's GPU takes nobody else
    pod = await cluster.core.read_namespaced_pod("pct", ns, _request_timeout=API_TIMEOUT_S)
    assert pod.metadata.annotations[keys.DEVICES_ALLOCATED] == f"{pct},NVIDIA,4000,0:;"
    await cluster.assert_invariant()


async def test_two_gpus_in_one_container_and_init_containers(
    cluster: Cluster, extender: ExtenderServer
) -> None:
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-{i}", i) for i in range(3)])
    await cluster.create(pod_body("two", container(gpu=2, gpumem=1000), selector=ns))
    _, slots = await cluster.bound("two")
    assert len(set(slots[0])) == 2
    await cluster.create(
        pod_body(
            "init",
            container("a", gpu=1, gpumem=1000),
            container("b"),
            container("c", gpu=1, gpumem=2000),
            init=[container("setup", gpu=1, gpumem=3000), container("plain")],
            selector=ns,
        )
    )
    _, slots = await cluster.bound("init")
    assert [len(s) for s in slots] == [1, 0, 1, 0, 1]
    await cluster.assert_invariant()


async def test_unfittable_pod_stays_pending_with_reason(cluster: Cluster, extender: ExtenderServer) -> None:
    ns = cluster.namespace
    await cluster.add_node("n", [gpu(f"GPU-{ns}-0", mem=8000)])
    await cluster.create(pod_body("huge", container(gpu=1, gpumem=16000), selector=ns))
    message = await cluster.unschedulable("huge", "CardInsufficientMemory")
    assert "1/1 CardInsufficientMemory" in message

    async def event() -> bool:
        events = await cluster.core.list_namespaced_event(ns, _request_timeout=API_TIMEOUT_S)
        return any(
            e.reason == "FilteringFailed" and "CardInsufficientMemory" in e.message for e in events.items
        )

    await wait_for(event, timeout=15, what="a FilteringFailed event")


async def test_a_native_sidecar_and_its_app_never_overfill_one_gpu(
    cluster: Cluster, extender: ExtenderServer
) -> None:
    # A sidecar (an init container restarted Always) runs beside the app for the pod's whole life:
    # 40000 + 40000 MiB must not go on one 60000 MiB GPU.
    ns = cluster.namespace
    await cluster.add_node("one", [gpu(f"GPU-{ns}-one", mem=60000)])
    sidecar = container("proxy", gpu=1, gpumem=40000, restartPolicy="Always")
    await cluster.create(pod_body("p", container("app", gpu=1, gpumem=40000), init=[sidecar], selector=ns))
    assert "1/1 CardInsufficientMemory" in await cluster.unschedulable("p", "CardInsufficientMemory")
    await cluster.add_node("two", [gpu(f"GPU-{ns}-two-{i}", i, mem=60000) for i in range(2)])
    node, slots = await cluster.bound("p")
    assert node == f"{ns}-two"
    assert sorted(slots[0] + slots[1]) == [f"GPU-{ns}-two-0", f"GPU-{ns}-two-1"]
    await cluster.assert_invariant()


async def test_pod_placed_after_register_annotation_changes(
    cluster: Cluster, extender: ExtenderServer
) -> None:
    ns = cluster.namespace
    name = await cluster.add_node("n", [gpu(f"GPU-{ns}-old", mem=4000)])
    new = [gpu(f"GPU-{ns}-new0", 0, mem=40000), gpu(f"GPU-{ns}-new1", 1, mem=40000)]
    await cluster.pool.nodes[name].patch_annotations({keys.NODE_REGISTER: encode_node_devices(new)})
    await cluster.create(pod_body("big", container(gpu=2, gpumem=30000), selector=ns))
    _, slots = await cluster.bound("big")
    assert sorted(slots[0]) == [f"GPU-{ns}-new0", f"GPU-{ns}-new1"]


async def test_lock_left_by_deleted_pod_does_not_stall_node(
    cluster: Cluster, extender: ExtenderServer
) -> None:
    ns = cluster.namespace
    name = await cluster.add_node("n", [gpu(f"GPU-{ns}-0")])
    stale = format_node_lock(NodeLock(datetime.now(UTC).replace(microsecond=0), ns, "deleted-long-ago"))
    await cluster.pool.nodes[name].patch_annotations({keys.NODE_LOCK: stale})
    started = asyncio.get_running_loop().time()
    await cluster.create(pod_body("p", selector=ns))
    await cluster.bound("p", timeout=15)
    assert asyncio.get_running_loop().time() - started < 15
    node = await cluster.core.read_node(name, _request_timeout=API_TIMEOUT_S)
    assert keys.NODE_LOCK not in (node.metadata.annotations or {})


async def test_pending_pods_claiming_a_nodes_gpus_do_not_block_it(
    cluster: Cluster, extender: ExtenderServer, kube_client: Any
) -> None:
    # Another tenant's pending pods, asking no GPU, annotated and labelled as holding the
    # node's only GPU (one well-formed, one malformed), never scheduled (no such scheduler).
    ns = cluster.namespace
    name = await cluster.add_node("n", [gpu(f"GPU-{ns}-0", count=1, mem=8000)])
    claim = encode_pod_devices([[ContainerDevice(f"GPU-{ns}-0", keys.DEVICE_VENDOR_NVIDIA, 8000, 100)]])
    tenant = await create_namespace(kube_client)
    core: Any = cluster.core
    try:
        squatters = []
        for pod_name, allocated in (("squat", claim), ("garbage", "not a device list")):
            body = builders.pod(
                pod_name,
                container(),
                labels={keys.VGPU_NODE_LABEL: name},
                annotations=builders.allocation(allocated=allocated, node=name, phase="allocating"),
                scheduler_name="no-such-scheduler",
            )
            created = await core.create_namespaced_pod(tenant, body, _request_timeout=API_TIMEOUT_S)
            squatters.append(created.metadata.uid)
        await wait_for(
            lambda: all(uid in extender.model.pending for uid in squatters),
            timeout=15,
            what="the extender to see the squatting pods",
        )
        await cluster.create(pod_body("p", container(gpu=1, gpumem=8000, gpucores=100), selector=ns))
        node, slots = await cluster.bound("p")
        assert (node, slots) == (name, [[f"GPU-{ns}-0"]])
        await cluster.assert_invariant()
    finally:
        await delete_namespace(kube_client, tenant)


# -- bursts ------------------------------------------------------------------------------------------

NODES = 5
GPUS = 4
SLOTS = 10
FITTABLE = NODES * GPUS * SLOTS  # 200
EXTRA = 10


async def burst(cluster: Cluster) -> None:
    ns = cluster.namespace
    for n in range(NODES):
        await cluster.add_node(f"n{n}", [gpu(f"GPU-{ns}-{n}-{i}", i, count=SLOTS) for i in range(GPUS)])
    gate = asyncio.Semaphore(16)

    async def create(i: int) -> None:
        async with gate:
            await cluster.create(pod_body(f"p{i}", container(gpu=1, gpumem=3000), selector=ns))

    await asyncio.gather(*(create(i) for i in range(FITTABLE + EXTRA)))

    async def all_bound() -> bool:
        pods = await cluster.core.list_namespaced_pod(ns, _request_timeout=API_TIMEOUT_S)
        return sum(1 for p in pods.items if p.spec.node_name) >= FITTABLE

    await wait_for(all_bound, timeout=150, interval=0.5, what=f"{FITTABLE} pods bound")
    pods = await cluster.core.list_namespaced_pod(ns, _request_timeout=API_TIMEOUT_S)
    assert sum(1 for p in pods.items if p.spec.node_name) == FITTABLE
    await cluster.assert_invariant()


@pytest.mark.timeout(240)
async def test_burst_with_one_replica(cluster: Cluster, extender: ExtenderServer) -> None:
    await burst(cluster)


async def caught_up_leader(servers: Sequence[ExtenderServer]) -> ExtenderServer:
    """The replica that leads, once its model has caught up (its binds decide from it)."""
    found = await wait_for(
        lambda: next((s for s in servers if s.leadership.exclusive()), None),
        timeout=30,
        what="an extender leader caught up",
    )
    assert found is not None
    return found


def counter(servers: Sequence[ExtenderServer], name: str, labels: dict[str, str]) -> float:
    return sum(s.telemetry.metrics.registry.get_sample_value(name, labels) or 0.0 for s in servers)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("balancing", ["per-request", "per-connection", "per-connection-redirect"])
async def test_burst_with_three_replicas(
    cluster: Cluster, kube_client: Any, hami_scheduler: Callable[..., Any], balancing: str
) -> None:
    """Three replicas electing a leader: kube-scheduler reaches them through a
    round-robin proxy (per-request balancing) or, as kube-proxy pins its kept-alive connection, one
    follower only (per-connection). The leader decides and binds; the others forward, or with
    ``--follower-redirect`` answer a 307 that kube-scheduler follows to the leader itself. Under 5 %
    of binds are refused, and only the leader binds."""
    redirect = balancing.endswith("-redirect")
    settings = dataclasses.replace(elected(cluster.namespace), follower_redirect=redirect)
    servers = await start_extenders(kube_client, 3, settings=settings)
    runner = None
    try:
        leader = await caught_up_leader(servers)
        followers = [s for s in servers if s is not leader]
        if balancing == "per-request":
            runner, url = await round_robin_proxy([s.url for s in servers])
        else:
            url = followers[0].url
        await use_extender(hami_scheduler, url)
        await burst(cluster)
        bound = counter(
            [leader],
            "hamipy_extender_decisions_total",
            {"verb": "bind", "result": "bound", "reason": "bound"},
        )
        refused = counter(
            servers,
            "hamipy_extender_decisions_total",
            {"verb": "bind", "result": "refused", "reason": "refused"},
        )
        assert bound >= FITTABLE
        assert refused < 0.05 * (bound + refused), (bound, refused)
        assert counter(followers, "hamipy_extender_bind_paths_total", {"path": "model"}) == 0
        assert counter(followers, "hamipy_extender_bind_paths_total", {"path": "locked"}) == 0
        assert counter([leader], "hamipy_extender_bind_paths_total", {"path": "model"}) >= FITTABLE
        result = "redirected" if redirect else "answered"
        forwarded = counter(followers, "hamipy_extender_forwarded_total", {"verb": "bind", "result": result})
        assert forwarded >= (1 if balancing == "per-request" else FITTABLE)
    finally:
        if runner is not None:
            await runner.cleanup()
        for server in servers:
            await server.stop()


async def test_each_replica_labels_its_own_pod_with_its_role(cluster: Cluster, kube_client: Any) -> None:
    """``--own-pod``: the label the chart's Service selects (``hami-py.io/extender-role=leader``) is
    on the leader's pod only, and moves to the new leader when the old one stops."""
    ns = cluster.namespace
    names = [f"extender-{i}" for i in range(2)]
    core: Any = cluster.core  # the body is a dict, not the generated V1Pod its stubs name
    for name in names:
        body = builders.pod(name, container(), scheduler_name="no-such-scheduler")
        await core.create_namespaced_pod(ns, body, _request_timeout=API_TIMEOUT_S)

    async def roles() -> dict[str, str]:
        pods = await cluster.core.list_namespaced_pod(ns, _request_timeout=API_TIMEOUT_S)
        return {
            p.metadata.name: (p.metadata.labels or {}).get(keys.EXTENDER_ROLE, "")
            for p in pods.items
            if p.metadata.name in names
        }

    servers = await start_extenders(
        kube_client, 2, settings=elected(ns), own_pods=[f"{ns}/{name}" for name in names]
    )
    try:
        first = await caught_up_leader(servers)
        want = {name: "leader" if s is first else "follower" for name, s in zip(names, servers, strict=True)}

        async def labelled() -> bool:
            return await roles() == want

        await wait_for(labelled, timeout=15, what=f"the roles {want}")
        await first.stop()
        (second,) = [name for name, s in zip(names, servers, strict=True) if s is not first]

        async def second_leads() -> bool:
            return (await roles())[second] == "leader"

        await wait_for(second_leads, timeout=30, what=f"{second} labelled the leader")
    finally:
        for server in servers:
            await server.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("standby", ["hot", "cold"])
async def test_a_new_leader_takes_over_and_binds_what_is_left(
    cluster: Cluster, kube_client: Any, hami_scheduler: Callable[..., Any], standby: str
) -> None:
    """The leader stops mid-burst (it releases the Lease); a follower leads, catches its model up
    and places the rest; nothing over-full, every fittable pod bound with its allocation. A cold
    standby (``--cold-standby``) has watched nothing until then: it lists the cluster first."""
    settings = dataclasses.replace(elected(cluster.namespace), cold_standby=standby == "cold")
    servers = await start_extenders(kube_client, 2, settings=settings)
    try:
        first = await caught_up_leader(servers)
        (second,) = [s for s in servers if s is not first]
        await use_extender(hami_scheduler, second.url)
        ns = cluster.namespace
        await cluster.add_node("n0", [gpu(f"GPU-{ns}-0-{i}", i, count=SLOTS) for i in range(GPUS)])
        for i in range(20):
            await cluster.create(pod_body(f"a{i}", container(gpu=1, gpumem=3000), selector=ns))
        if standby == "cold":
            await wait_for(lambda: len(first.model.contributions) >= 1, timeout=30, what="a pod placed")
            assert not second.health.watching
            assert not second.model.nodes
            assert not second.model.contributions
        await first.stop()
        await wait_for(second.leadership.exclusive, timeout=30, what="the follower to lead, caught up")
        for i in range(20):
            await cluster.create(pod_body(f"b{i}", container(gpu=1, gpumem=3000), selector=ns))

        async def all_bound() -> bool:
            pods = await cluster.core.list_namespaced_pod(ns, _request_timeout=API_TIMEOUT_S)
            return sum(1 for p in pods.items if p.spec.node_name) == 40

        await wait_for(all_bound, timeout=120, interval=0.5, what="40 pods bound")
        pods = await cluster.core.list_namespaced_pod(ns, _request_timeout=API_TIMEOUT_S)
        assert all(keys.DEVICES_ALLOCATED in (p.metadata.annotations or {}) for p in pods.items)
        await cluster.assert_invariant()
    finally:
        for server in servers:
            await server.stop()
