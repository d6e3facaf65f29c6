"""Our extender with its default settings beside HAMi's device plugin.

HAMi's device plugin serves the pod the node lock names, and releases the lock after its Allocate.
With the lock released at bind (our fast discipline), a second bind re-locks the node before the
first pod is admitted, and HAMi's plugin hands the first pod's container the second pod's GPUs, or
fails the Allocate (``UnexpectedAdmissionError``). On a node HAMi's device plugin registered (no
marker of ours) the extender therefore holds the lock until that Allocate.

One node, four GPUs of four slots registered as HAMi's plugin registers them, the kubelet stand-in
and a device plugin that behaves as HAMi's (``hami_device_plugin``); a burst of pods created at
once. Every pod is admitted, every container gets exactly the GPUs its pod's allocation names, and
no lock is left.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body
from hami_device_plugin import HamiLikeDevicePlugin, add_hami_node
from stack_support import start_extenders, use_extender

from hamipy.devcluster import API_TIMEOUT_S, NodePool, wait_for
from hamipy.devcluster.kubelet_standin import KubeletStandIn
from hamipy.extender.server import ExtenderServer
from hamipy.kube.client import RawKube
from hamipy.protocol import keys
from hamipy.protocol.pod_devices import decode_pod_devices

pytestmark = pytest.mark.integration

GPUS = 4
SLOTS = 4
PODS = 12


@pytest.fixture
async def extender(kube_client: Any, hami_scheduler: Callable[..., Any]) -> AsyncIterator[ExtenderServer]:
    (server,) = await start_extenders(kube_client)  # default settings: release-lock-after-bind
    await use_extender(hami_scheduler, server.url)
    yield server
    await server.stop()


@pytest.fixture
async def hami_node(
    kube_client: Any, namespace: str, node_pool: NodePool, plugin_dir: Path
) -> tuple[str, KubeletStandIn, HamiLikeDevicePlugin]:
    name = f"{namespace}-h"
    devices = [gpu(f"GPU-{namespace}-{i}", i, count=SLOTS) for i in range(GPUS)]
    agents = await add_hami_node(
        node_pool,
        RawKube(kube_client),
        name,
        devices,
        labels={"extender-test": namespace},
        plugin_dir=plugin_dir,
    )
    return name, *agents


async def test_a_burst_on_a_node_hamis_plugin_serves_gets_every_container_its_own_gpus(
    kube_client: Any,
    namespace: str,
    node_pool: NodePool,
    extender: ExtenderServer,
    hami_node: tuple[str, KubeletStandIn, HamiLikeDevicePlugin],
) -> None:
    node, standin, plugin = hami_node
    cluster = Cluster(kube_client, namespace, node_pool)
    await asyncio.gather(
        *(
            cluster.create(pod_body(f"p{i}", container(gpu=1, gpumem=1000), selector=namespace))
            for i in range(PODS)
        )
    )

    async def admitted() -> list[Any]:
        pods = await cluster.core.list_namespaced_pod(namespace, _request_timeout=API_TIMEOUT_S)
        phases = [p.status.phase for p in pods.items]
        return pods.items if all(phase in ("Running", "Failed") for phase in phases) else []

    pods = await wait_for(admitted, timeout=90, what=f"all {PODS} pods admitted or refused by the node")
    failed = [
        f"{p.metadata.name}: {p.status.reason} {p.status.message}" for p in pods if p.status.phase == "Failed"
    ]
    assert failed == [], "admission failures"
    wrong = []
    for p in pods:
        (slot,) = decode_pod_devices(p.metadata.annotations[keys.DEVICES_ALLOCATED])
        planned = ",".join(d.uuid for d in slot)
        got = (await standin.wait_allocated(namespace, p.metadata.name, "main")).envs[
            "NVIDIA_VISIBLE_DEVICES"
        ]
        if got != planned:
            wrong.append(f"{p.metadata.name}: planned {planned}, given {got}")
    assert wrong == [], "containers given another pod's GPUs"
    assert len(plugin.served) == PODS
    assert all(p.metadata.annotations[keys.BIND_PHASE] == "success" for p in pods)
    found = await cluster.core.read_node(node, _request_timeout=API_TIMEOUT_S)
    assert keys.NODE_LOCK not in (found.metadata.annotations or {}), "a lock left behind"
    await cluster.assert_invariant()
