"""Three kube-schedulers with the ``hami-scheduler`` profile and no leader election, all calling one
extender, on the real control plane: every pod is filtered and bound by each of them, so two or
three binds of one pod are in flight at once, or arrive after the first has bound it and before the
pod's watch event. A pod's GPUs stay counted through all of that: after a burst that fills every
GPU, no GPU is over capacity in the pods' annotations, and exactly the pods that fit are bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body, replica_metric
from extender_processes import ExtenderProcess, start_extender_processes, stop_extenders
from stack_support import extender_config

from hamipy.devcluster import API_TIMEOUT_S, DevCluster, NodePool, SchedulerConfig, WaitTimeout, wait_for
from hamipy.extender.invariant import check_cluster
from hamipy.kube.client import RawKube

pytestmark = pytest.mark.integration

NODES = 3
GPUS = 2
SLOTS = 10
FITTABLE = NODES * GPUS * SLOTS  # 60 pods of one slot each
EXTRA = 12
SCHEDULERS = ("unelected-a", "unelected-b", "unelected-c")


@pytest.fixture
async def extender(devcluster: DevCluster, tmp_path: Path) -> AsyncIterator[ExtenderProcess]:
    """One ``hamipy-extender serve`` (no leader election: it alone decides, from its model)."""
    (process,) = await start_extender_processes(
        1, "binpack", kubeconfig=Path(devcluster.access.kubeconfig), workdir=tmp_path
    )
    try:
        yield process
    finally:
        await stop_extenders([process])


async def placement(cluster: Cluster) -> tuple[list[Any], list[Any]]:
    """The namespace's pods: (bound, pending)."""
    pods = await cluster.core.list_namespaced_pod(cluster.namespace, _request_timeout=API_TIMEOUT_S)
    bound = [p for p in pods.items if p.spec.node_name]
    return bound, [p for p in pods.items if not p.spec.node_name]


def refused(pod: Any) -> bool:
    """kube-scheduler has marked the pod unschedulable (``PodScheduled=False``)."""
    return any(c.type == "PodScheduled" and c.status == "False" for c in (pod.status.conditions or ()))


@pytest.mark.timeout(300)
async def test_three_unelected_schedulers_never_put_a_gpu_over_capacity(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    node_pool: NodePool,
    extender: ExtenderProcess,
) -> None:
    cluster = Cluster(kube_client, namespace, node_pool)
    for n in range(NODES):
        devices = [gpu(f"GPU-{namespace}-{n}-{i}", i, count=SLOTS, mem=SLOTS * 3000) for i in range(GPUS)]
        await cluster.add_node(f"n{n}", devices)
    config = SchedulerConfig.hami(extender_config(extender.url), percentage_of_nodes_to_score=100)
    try:
        for name in SCHEDULERS:
            await asyncio.to_thread(devcluster.start_scheduler, config, name=name)
        gate = asyncio.Semaphore(16)

        async def create(i: int) -> None:
            async with gate:
                body = pod_body(f"p{i}", container(gpu=1, gpumem=3000), selector=namespace)
                await cluster.create(body)

        await asyncio.gather(*(create(i) for i in range(FITTABLE + EXTRA)))
        story: list[str] = []

        async def settled() -> bool:
            bound, pending = await placement(cluster)
            story[:] = [f"{len(bound)} bound, {len(pending)} pending"]
            return len(bound) >= FITTABLE and all(refused(p) for p in pending)

        try:
            await wait_for(settled, timeout=180, interval=0.5, what="every pod placed or refused")
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}: {story}") from None
        report = await check_cluster(RawKube(kube_client))
        assert report.ok, "\n".join(map(str, report.violations))
        bound, pending = await placement(cluster)
        assert (len(bound), len(pending)) == (FITTABLE, EXTRA)
        repeats = await replica_metric(extender, "hamipy_extender_bind_races_total")
        print(f"\nunelected schedulers: {repeats:g} binds of pods another bind had bound first")
        assert repeats > 0, "no pod was bound twice: nothing was tested"
    finally:
        for name in SCHEDULERS:
            await asyncio.to_thread(devcluster.stop_scheduler, name)
