"""Failover with kills and API stalls, on the real control plane.

Three extender replicas, each ``hamipy-extender serve`` in its own process, elect their leader by a
Lease and sit behind one URL balanced per request; three nodes are served by our device plugin and
one by HAMi's (binds there take the node lock). Mid-burst:

- **kills**: two kube-schedulers with the ``hami-scheduler`` profile elect theirs by another Lease,
  as a highly available control plane runs them; the leading kube-scheduler and the leading
  extender are killed with SIGKILL at once. Nothing is released, the binds in flight die with them.
  Within ``SETTLE_S`` of the kills:
- **stall**: kube-apiserver is frozen (SIGSTOP) for ``STALL_S``, longer than the extenders' renew
  deadline and Lease, as an etcd or apiserver stall does it; the leader steps down, binds in flight
  fail, lock releases are owed. Within ``RECOVER_S`` of the API answering again:

every pod that fits is bound with its allocation, the rest are pending with kube-scheduler's reason,
no GPU is over-full, and no node lock or reservation is left behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body, replica_metric, round_robin_proxy
from extender_processes import ExtenderProcess, start_extender_processes, stop_extenders
from hami_device_plugin import add_hami_node
from kubernetes_asyncio.client import CoordinationV1Api
from stack_support import extender_config

from hamipy.devcluster import (
    API_TIMEOUT_S,
    DevCluster,
    NodePool,
    SchedulerConfig,
    SchedulerLeaderElection,
    WaitTimeout,
    wait_for,
)
from hamipy.kube.client import RawKube
from hamipy.protocol import keys

pytestmark = pytest.mark.integration

GPUS = 4
SLOTS = 10
OUR_NODES = 3
FITTABLE = (OUR_NODES + 1) * GPUS * SLOTS  # 160: three nodes our device plugin serves, one HAMi's
EXTRA = 10
FAULT_AFTER = 40
"""Bound pods before the fault: the burst is well under way, most of it still to place."""

LEASE_S = 8.0
"""Every Lease: how long a dead leader's Lease stands before a standby takes it."""
BIND_TIMEOUT_S = 5.0
SETTLE_S = 45.0
"""From the kills to every pod placed or refused: the Lease running out (8 s), the new extender
leader catching its model up, and kube-scheduler's backoff for the pods whose calls failed
(at most 10 s) twice over, with room for this 2-core machine."""
STALL_S = 25.0
RECOVER_S = 30.0
"""From the API answering again to every pod placed or refused (docs/extender.md#replicas)."""

LOCK_EXPIRY_S = 20.0
"""HAMi's node: a binder killed between taking the lock and its Binding leaves the lock to expiry
(HAMi's discipline: nothing else knows the bind is dead); 5 minutes by default, short here."""

SCHEDULERS = ("hami-a", "hami-b")
EXTENDER_LEASE = "hami-py-extender"


def elected_flags(namespace: str) -> list[str]:
    """The replicas' flags: leader election in ``namespace`` with the test's times (lease > renew
    deadline + API timeout, so a killed leader's last bind has landed or failed before anyone
    else leads)."""
    return [
        "--leader-elect",
        "--lease-namespace",
        namespace,
        "--lease-name",
        EXTENDER_LEASE,
        "--lease-duration",
        f"{LEASE_S:g}",
        "--renew-deadline",
        "4",
        "--retry-period",
        "0.5",
        "--api-timeout",
        "3",
        "--bind-timeout",
        f"{BIND_TIMEOUT_S:g}",
        "--lock-sweep-interval",
        "1",
        "--lock-expiry",
        f"{LOCK_EXPIRY_S:g}",
    ]


def replica_flags(index: int, port: int) -> list[str]:
    return ["--identity", f"replica-{index}", "--advertise-url", f"http://127.0.0.1:{port}"]


@dataclasses.dataclass
class Replicated:
    """The test's nodes and extender replicas behind one URL."""

    cluster: Cluster
    extenders: list[ExtenderProcess]
    url: str
    hamis: str
    """HAMi's node, where binds take the node lock."""
    cold: bool = False
    """The replicas are cold standbys: only one that has led holds a model."""


@pytest.fixture(params=["hot"])
async def rig(
    request: pytest.FixtureRequest,
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    node_pool: NodePool,
    tmp_path: Path,
    plugin_dir: Path,
) -> AsyncIterator[Replicated]:
    """The nodes and the three extender replicas behind one URL; stopped after the test. The
    replicas are hot standbys, or cold ones (``--cold-standby``) where a test parametrizes ``rig``
    with ``"cold"``."""
    standby = ["--cold-standby"] if request.param == "cold" else []
    cluster = Cluster(kube_client, namespace, node_pool)
    ns = namespace
    for n in range(OUR_NODES):
        await cluster.add_node(f"n{n}", [gpu(f"GPU-{ns}-{n}-{i}", i, count=SLOTS) for i in range(GPUS)])
    hamis = f"{ns}-h0"
    await add_hami_node(
        node_pool,
        RawKube(kube_client),
        hamis,
        [gpu(f"GPU-{ns}-h-{i}", i, count=SLOTS) for i in range(GPUS)],
        labels={"extender-test": ns},
        plugin_dir=plugin_dir,
    )
    extenders = await start_extender_processes(
        3,
        "binpack",
        kubeconfig=Path(devcluster.access.kubeconfig),
        workdir=tmp_path,
        extra_args=[*elected_flags(ns), *standby],
        replica_args=replica_flags,
    )
    runner = None
    try:
        runner, url = await round_robin_proxy([e.url for e in extenders])
        yield Replicated(cluster, extenders, url, hamis, cold=bool(standby))
    finally:
        if runner is not None:
            await runner.cleanup()
        await stop_extenders(extenders)


async def burst(cluster: Cluster) -> None:
    """Every pod of the burst created, 16 at a time: ``FITTABLE`` fit, ``EXTRA`` more do not."""
    gate = asyncio.Semaphore(16)

    async def create(i: int) -> None:
        async with gate:
            await cluster.create(pod_body(f"p{i}", container(gpu=1, gpumem=3000), selector=cluster.namespace))

    await asyncio.gather(*(create(i) for i in range(FITTABLE + EXTRA)))


def scheduler_log(devcluster: DevCluster, name: str) -> str:
    return devcluster.log_path(f"kube-scheduler-{name}").read_text(errors="replace")


def leads(devcluster: DevCluster, name: str) -> bool:
    """The kube-scheduler ``name`` has taken its Lease (klog: "successfully acquired lease")."""
    return "successfully acquired lease" in scheduler_log(devcluster, name)


async def lease_holder(api: Any, namespace: str, name: str) -> str:
    lease = await CoordinationV1Api(api).read_namespaced_lease(
        name, namespace, _request_timeout=API_TIMEOUT_S
    )
    return str(lease.spec.holder_identity or "")


async def extender_leader(api: Any, namespace: str, extenders: Sequence[ExtenderProcess]) -> ExtenderProcess:
    holder = await wait_for(
        lambda: lease_holder(api, namespace, EXTENDER_LEASE), timeout=30, what="an extender leader"
    )
    (leader,) = [e for e in extenders if holder.startswith(f"replica-{e.index}")]
    return leader


async def held(extender: ExtenderProcess, source: str) -> float:
    """The replica's ``hamipy_extender_pods_held{source}``."""
    return await replica_metric(extender, "hamipy_extender_pods_held", source=source)


async def placement(cluster: Cluster) -> tuple[list[Any], list[Any]]:
    """The namespace's pods: (bound, pending)."""
    pods = await cluster.core.list_namespaced_pod(cluster.namespace, _request_timeout=API_TIMEOUT_S)
    bound = [p for p in pods.items if p.spec.node_name]
    return bound, [p for p in pods.items if not p.spec.node_name]


async def wait_bound(cluster: Cluster, n: int) -> int:
    """Wait for at least ``n`` of the burst bound; how many are."""

    async def count() -> int:
        bound = len((await placement(cluster))[0])
        return bound if bound >= n else 0  # 0: not yet

    return await wait_for(count, timeout=120, interval=0.2, what=f"{n} pods bound")


def unschedulable_reason(pod: Any) -> str:
    """kube-scheduler's message on the pod's ``PodScheduled=False`` condition ("" if none)."""
    for condition in pod.status.conditions or ():
        if condition.type == "PodScheduled" and condition.status == "False":
            return str(condition.message or condition.reason or "")
    return ""


async def settle(cluster: Cluster, since: float, *, bound_s: float) -> float:
    """Wait until every pod that fits is bound and the rest are refused with a reason; the seconds
    from ``since`` that took, asserted within ``bound_s``. A timeout names what each pending pod waits for."""
    story: list[str] = []

    async def settled() -> bool:
        bound, pending = await placement(cluster)
        story[:] = [f"{len(bound)} bound"] + [
            f"{p.metadata.name}: {unschedulable_reason(p) or 'no reason'}" for p in pending
        ]
        return len(bound) == FITTABLE and all(unschedulable_reason(p) for p in pending)

    try:
        await wait_for(settled, timeout=bound_s + 30, interval=0.5, what="every pod placed or refused")
    except WaitTimeout as exc:
        raise AssertionError(f"{exc}\n" + "\n".join(story[:30])) from None
    took = time.monotonic() - since
    assert took <= bound_s, f"placing the rest took {took:.1f} s, more than {bound_s:g} s"
    return took


async def assert_nothing_lost_or_left(rig: Replicated, replicas: Sequence[ExtenderProcess]) -> None:
    """Each bound pod carries its allocation, no GPU is over-full, no lock is left on HAMi's node
    (the sweep frees what a dead or failed bind held), and ``replicas``' models hold every placed
    pod once, with no reservation or bind in flight."""
    bound, pending = await placement(rig.cluster)
    assert len(pending) == EXTRA
    unallocated = [
        p.metadata.name for p in bound if keys.DEVICES_ALLOCATED not in (p.metadata.annotations or {})
    ]
    assert unallocated == [], f"bound without an allocation: {unallocated}"
    await rig.cluster.assert_invariant()
    unlocked = functools.partial(_unlocked, rig.cluster, rig.hamis)
    await wait_for(unlocked, timeout=BIND_TIMEOUT_S + 15, what=f"no lock left on {rig.hamis}")
    for source in ("reserved", "binding"):
        none_held = functools.partial(_none_held, replicas, source)
        await wait_for(none_held, timeout=30, what=f"no pod {source}")
    for replica in replicas:
        assert await held(replica, "allocated") == FITTABLE


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rig", ["hot", "cold"], indirect=True)
async def test_killing_the_leading_scheduler_and_extender_mid_burst_loses_nothing(
    devcluster: DevCluster, kube_client: Any, namespace: str, rig: Replicated
) -> None:
    election = SchedulerLeaderElection(
        namespace, lease_duration_s=LEASE_S, renew_deadline_s=4, retry_period_s=1
    )
    config = SchedulerConfig.hami(
        extender_config(rig.url), percentage_of_nodes_to_score=100, leader_election=election
    )
    try:
        # The first scheduler leads before the second starts: which one to kill is then known.
        await asyncio.to_thread(devcluster.start_scheduler, config, name=SCHEDULERS[0])
        await wait_for(lambda: leads(devcluster, SCHEDULERS[0]), timeout=30, what="hami-a to lead")
        await asyncio.to_thread(devcluster.start_scheduler, config, name=SCHEDULERS[1])
        leader = await extender_leader(kube_client, namespace, rig.extenders)

        creating = asyncio.create_task(burst(rig.cluster))
        try:
            bound_at_kill = await wait_bound(rig.cluster, FAULT_AFTER)
            scheduler = devcluster.processes[f"kube-scheduler-{SCHEDULERS[0]}"]
            assert scheduler.pid is not None
            os.kill(scheduler.pid, signal.SIGKILL)
            await leader.kill()
            killed_at = time.monotonic()
        finally:
            await creating
        assert bound_at_kill < FITTABLE, "the burst ended before the kills: nothing was tested"

        took = await settle(rig.cluster, killed_at, bound_s=SETTLE_S)
        print(f"\nfailover: killed at {bound_at_kill} bound; all {FITTABLE} placed {took:.1f} s after")
        assert leads(devcluster, SCHEDULERS[1]), "the standby kube-scheduler never took over"
        survivors = [e for e in rig.extenders if e is not leader]
        if rig.cold:  # the follower that never led holds no model to check
            survivors = [await extender_leader(kube_client, namespace, survivors)]
        await assert_nothing_lost_or_left(rig, survivors)
    finally:
        for name in SCHEDULERS:
            await asyncio.to_thread(devcluster.stop_scheduler, name)


@pytest.mark.timeout(300)
async def test_an_api_stall_mid_burst_recovers_within_30s_and_leaves_nothing_behind(
    devcluster: DevCluster, kube_client: Any, namespace: str, rig: Replicated, hami_scheduler: Any
) -> None:
    hami_scheduler(extender_config(rig.url))
    await extender_leader(kube_client, namespace, rig.extenders)
    await burst(rig.cluster)
    bound_at_stall = await wait_bound(rig.cluster, FAULT_AFTER)
    apiserver = devcluster.processes["kube-apiserver"]
    assert apiserver.pid is not None
    os.kill(apiserver.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(STALL_S)  # the fault's length, not a wait for anything
    finally:
        os.kill(apiserver.pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    assert bound_at_stall < FITTABLE, "the burst ended before the stall: nothing was tested"

    took = await settle(rig.cluster, resumed_at, bound_s=RECOVER_S)
    print(f"\napi stall: frozen at {bound_at_stall} bound; all {FITTABLE} placed {took:.1f} s after")
    await assert_nothing_lost_or_left(rig, rig.extenders)


async def _unlocked(cluster: Cluster, node: str) -> bool:
    found = await cluster.core.read_node(node, _request_timeout=API_TIMEOUT_S)
    return keys.NODE_LOCK not in (found.metadata.annotations or {})


async def _none_held(extenders: Sequence[ExtenderProcess], source: str) -> bool:
    return all([await held(e, source) == 0 for e in extenders])
