"""Benchmark: pods placed end to end through the real kube-scheduler (docs/design.md#performance-targets:
pods/s at 1,000 simulated nodes, reported against the earlier 200 pods/s target; 40 identical pods
onto one 8-GPU node all bound and allocated within seconds).

Run as a script: ``.venv/bin/python tests/bench/bench_e2e.py [--nodes 1000] [--pods 1000]``.

Part 1, placement rate: a devcluster, ``--nodes`` simulated nodes registering 8 GPUs each (the
register annotation and ``nvidia.com/gpu`` capacity, as the device plugin writes them), one extender
in this process wired into the ``hami-scheduler`` kube-scheduler (adaptive
``percentageOfNodesToScore``), then ``--pods`` GPU pods created at once; measured from the first
create to the last pod bound, and per pod from its creation to its binding.

Part 2, one node: a simulated GPU node with 8 GPUs, its real device-plugin process over the fake
NVML driver and the kubelet stand-in; 40 identical pods (1 GPU, 4 GiB, 10 % cores) created at once
and timed until every one is bound and allocated (``hami.io/bind-phase=success``).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _results import percentiles_us, record
from kubernetes_asyncio.client import CoreV1Api

from hamipy.devcluster import (
    DevCluster,
    ExtenderConfig,
    ManagedResource,
    NodePool,
    NodeSpec,
    SchedulerConfig,
    create_namespace,
    delete_namespace,
    wait_for_default_service_account,
)
from hamipy.devcluster.binaries import ensure_binaries
from hamipy.devcluster.cluster import ClusterSettings
from hamipy.devcluster.gpu_nodes import FakeGpu, gpu_node_agents
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import RawKube
from hamipy.protocol import DeviceInfo, encode_node_devices, keys
from hamipy.protocol.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
GPUS = 8
TARGET_PODS_PER_S = 200.0
TIMEOUT_S = 600.0
MANAGED = tuple(ManagedResource(r) for r in (keys.RESOURCE_COUNT, keys.RESOURCE_MEMORY, keys.RESOURCE_CORES))


def gpu_pod(name: str, *, selector: dict[str, str], mem: int, cores: int) -> dict[str, Any]:
    limits = {keys.RESOURCE_COUNT: "1", keys.RESOURCE_MEMORY: str(mem), keys.RESOURCE_CORES: str(cores)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": "hami-scheduler",
            "nodeSelector": selector,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "main", "image": "registry.invalid/app:1", "resources": {"limits": limits}}
            ],
        },
    }


async def create_all(core: Any, namespace: str, bodies: list[dict[str, Any]]) -> dict[str, float]:
    """Create every pod (32 in flight); each pod's creation time."""
    created: dict[str, float] = {}
    gate = asyncio.Semaphore(32)

    async def one(body: dict[str, Any]) -> None:
        async with gate:
            await core.create_namespaced_pod(namespace, body, _request_timeout=30)
            created[body["metadata"]["name"]] = time.perf_counter()

    await asyncio.gather(*(one(b) for b in bodies))
    return created


async def wait_all(core: Any, namespace: str, names: set[str], done: Any) -> dict[str, float]:
    """List the namespace's pods as raw JSON every 0.25 s until ``done(pod)`` for every name; when
    each was first seen done (0.25 s resolution: decoding 1,000 pods into models as often as every
    50 ms took more CPU than the scheduling it measured)."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(seen) < len(names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(names) - len(seen)} pods not done after {TIMEOUT_S:g}s")
        resp = await core.list_namespaced_pod(namespace, _preload_content=False, _request_timeout=30)
        try:
            items = json.loads(await resp.read())["items"]
        finally:
            resp.release()
        now = time.perf_counter()
        for pod in items:
            name = pod["metadata"]["name"]
            if name in names and name not in seen and done(pod):
                seen[name] = now
        await asyncio.sleep(0.25)  # a benchmark's sampling tick, not test synchronisation
    return seen


async def start_extender(cluster: DevCluster, api: Any, config: Config) -> ExtenderServer:
    """One extender in this process, synced, and the hami-scheduler (re)started to call it."""
    server = ExtenderServer(
        config=config,
        settings=ExtenderSettings(handshake_interval_s=0),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=RawKube(api),
    )
    await server.start()
    await server.wait_synced(120)
    extender = ExtenderConfig(
        url_prefix=server.url,
        bind_verb="bind",
        node_cache_capable=True,
        managed_resources=MANAGED,
        http_timeout_s=30,
    )
    await asyncio.to_thread(cluster.start_scheduler, SchedulerConfig.hami(extender), name="hami")
    return server


async def add_nodes(pool: NodePool, nodes: int) -> float:
    """Register ``nodes`` GPU nodes as the device plugin would; seconds it took."""
    started = time.perf_counter()
    for i in range(nodes):
        devices = [
            DeviceInfo(
                f"GPU-{i:05d}-{g}", g, 10, 40960, 100, "NVIDIA-A100-SXM4-40GB", g // 4, "hami-core", True
            )
            for g in range(GPUS)
        ]
        await pool.add(
            NodeSpec(
                name=f"bench-{i:05d}",
                labels={"bench": "rate"},
                annotations={keys.NODE_REGISTER: encode_node_devices(devices)},
                capacity={keys.RESOURCE_COUNT: str(GPUS * 10)},
            )
        )
    return time.perf_counter() - started


async def placement_rate(cluster: DevCluster, api: Any, nodes: int, pods: int, policy: str) -> dict[str, Any]:
    core = CoreV1Api(api)
    namespace = await create_namespace(api)
    server = await start_extender(cluster, api, load_config(f"nodeSchedulerPolicy: {policy}\n"))
    try:
        bodies = [
            gpu_pod(f"rate-{i:05d}", selector={"bench": "rate"}, mem=2000, cores=5) for i in range(pods)
        ]
        first = time.perf_counter()
        created, bound = await asyncio.gather(
            create_all(core, namespace, bodies),
            wait_all(
                core,
                namespace,
                {b["metadata"]["name"] for b in bodies},
                lambda p: bool(p["spec"].get("nodeName")),
            ),
        )
        elapsed = max(bound.values()) - first
        registry = server.telemetry.metrics.registry
        mean_ms = {
            verb: round(
                1000
                * sum(
                    registry.get_sample_value(f"hamipy_extender_{verb}_duration_seconds_sum", {"result": r})
                    or 0
                    for r in results
                )
                / max(
                    1.0,
                    sum(
                        registry.get_sample_value(
                            f"hamipy_extender_{verb}_duration_seconds_count", {"result": r}
                        )
                        or 0
                        for r in results
                    ),
                ),
                2,
            )
            for verb, results in (("filter", ("fit", "failed")), ("bind", ("bound", "refused", "error")))
        }
    finally:
        await server.stop()
        await delete_namespace(api, namespace)
    rate = pods / elapsed
    return {
        "node_policy": policy,
        "nodes": nodes,
        "pods": pods,
        "all_bound_in_s": round(elapsed, 2),
        "pods_per_s": round(rate, 1),
        "create_to_bound": percentiles_us([bound[n] - created[n] for n in created]),
        "extender_mean_ms": mean_ms,
        "target_pods_per_s": TARGET_PODS_PER_S,
        "met": rate >= TARGET_PODS_PER_S,
    }


async def one_node(cluster: DevCluster, api: Any, pool: NodePool, workdir: Path) -> dict[str, Any]:
    core = CoreV1Api(api)
    await wait_for_default_service_account(api, "default")
    gpus = [FakeGpu(f"GPU-00000e2e-0000-4000-8000-{g:012x}", memory_mib=40960) for g in range(GPUS)]
    standin, plugin = gpu_node_agents(
        workdir=workdir,
        gpus=gpus,
        kubeconfig=Path(cluster.access.kubeconfig),
        native_build=ROOT / "native" / "build",
    )
    await pool.add(NodeSpec(name="bench-gpu", labels={"bench": "one-node"}), agents=(standin, plugin))
    server = await start_extender(cluster, api, Config())
    try:
        bodies = [
            gpu_pod(f"one-{i:02d}", selector={"bench": "one-node"}, mem=4096, cores=10) for i in range(40)
        ]
        first = time.perf_counter()
        created, served = await asyncio.gather(
            create_all(core, "default", bodies),
            wait_all(
                core,
                "default",
                {b["metadata"]["name"] for b in bodies},
                lambda p: (p["metadata"].get("annotations") or {}).get(keys.BIND_PHASE) == "success",
            ),
        )
    finally:
        await server.stop()
    return {
        "pods": 40,
        "gpus": GPUS,
        "all_allocated_in_s": round(max(served.values()) - first, 2),
        "create_to_allocated": percentiles_us([served[n] - created[n] for n in created]),
    }


async def run(nodes: int, pods: int) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="hamipy-e2e-", dir="/tmp") as tmp,
        DevCluster(ClusterSettings(), binaries=ensure_binaries()) as cluster,
    ):
        async with cluster.api_client() as api:
            async with NodePool(api, heartbeat_interval_s=300) as pool:
                nodes_s = await add_nodes(pool, nodes)
                binpack = await placement_rate(cluster, api, nodes, pods, "binpack")
                spread = await placement_rate(cluster, api, nodes, pods, "spread")
            async with NodePool(api) as pool:
                node = await one_node(cluster, api, pool, Path(tmp))
    return {
        "nodes_registered_in_s": round(nodes_s, 1),
        "placement_binpack": binpack,
        "placement_spread": spread,
        "one_8_gpu_node_40_pods": node,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=1000)
    args = parser.parse_args()
    record("e2e_placement", asyncio.run(run(args.nodes, args.pods)))


if __name__ == "__main__":
    main()
