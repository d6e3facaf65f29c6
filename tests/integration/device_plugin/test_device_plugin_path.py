"""The whole path of a GPU pod (issue 7, "Done when"): webhook -> kube-scheduler -> extender ->
bind -> kubelet stand-in -> the real device plugin process over the fake NVML -> Allocate.

Each test runs one simulated GPU node (``gpu_node_agents``: the stand-in and a
``hamipy-device-plugin`` process), the webhook and one extender in this process, and the real
control plane. Pods are created without a scheduler name: the webhook routes them.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import CoreV1Api
from stack_support import start_extenders, start_webhook, stop_webhook, use_extender

from hamipy.devcluster import API_TIMEOUT_S, DevCluster, NodePool, NodeSpec, wait_for
from hamipy.devcluster.gpu_nodes import DevicePluginAgent, FakeGpu, gpu_node_agents
from hamipy.devcluster.kubelet_standin import ContainerAllocation, KubeletStandIn
from hamipy.extender.invariant import check_cluster
from hamipy.extender.kube import ApiClientKube
from hamipy.protocol import ContainerDevice, decode_node_devices, decode_pod_devices, keys

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
NATIVE_BUILD = ROOT / "native" / "build"
RESOURCE = keys.RESOURCE_COUNT
GPUS = (
    FakeGpu("GPU-aaaaaaaa-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-80GB", 81920, numa=0),
    FakeGpu("GPU-aaaaaaaa-0000-4000-8000-000000000001", "NVIDIA A100-SXM4-80GB", 81920, numa=1),
)


class GpuStack:
    """One GPU node with its plugin and stand-in, and helpers to create and inspect pods."""

    def __init__(
        self, api: Any, namespace: str, node: str, standin: KubeletStandIn, plugin: DevicePluginAgent
    ):
        self.api = api
        self.core = CoreV1Api(api)
        self.namespace = namespace
        self.node = node
        self.standin = standin
        self.plugin = plugin

    def pod_body(
        self, name: str, containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "containers": containers,
            "nodeSelector": {"gpu-test": self.namespace},
            "terminationGracePeriodSeconds": 0,
        }
        if init:
            spec["initContainers"] = list(init)
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}

    async def create(self, body: dict[str, Any]) -> None:
        await self.core.create_namespaced_pod(self.namespace, body, _request_timeout=API_TIMEOUT_S)

    async def pod(self, name: str) -> dict[str, Any]:
        pod = await self.core.read_namespaced_pod(name, self.namespace, _request_timeout=API_TIMEOUT_S)
        out: dict[str, Any] = self.api.sanitize_for_serialization(pod)
        return out

    async def served(self, name: str, timeout: float = 60) -> dict[str, Any]:  # noqa: ASYNC109
        """The pod once its device plugin has marked it ``bind-phase=success``."""

        async def done() -> dict[str, Any] | None:
            pod = await self.pod(name)
            phase = (pod["metadata"].get("annotations") or {}).get(keys.BIND_PHASE)
            assert phase != "failed", f"pod {name} failed allocation: {pod['metadata'].get('annotations')}"
            return pod if phase == "success" else None

        result: dict[str, Any] = await wait_for(
            done, timeout=timeout, interval=0.1, what=f"pod {name} served"
        )
        return result

    async def allocation(self, pod: str, container: str) -> ContainerAllocation:
        return await self.standin.wait_allocated(self.namespace, pod, container, timeout_s=60)


def gpu_container(
    name: str, *, gpus: int = 1, mem: int | None = None, cores: int | None = None
) -> dict[str, Any]:
    limits = {RESOURCE: str(gpus)}
    if mem is not None:
        limits[keys.RESOURCE_MEMORY] = str(mem)
    if cores is not None:
        limits[keys.RESOURCE_CORES] = str(cores)
    return {"name": name, "image": "registry.k8s.io/pause:3.10", "resources": {"limits": limits}}


def plain_container(name: str) -> dict[str, Any]:
    return {"name": name, "image": "registry.k8s.io/pause:3.10"}


def assert_matches_slot(
    allocation: ContainerAllocation, slot: list[ContainerDevice], hook: Path, uid: str
) -> None:
    """The container's env and mounts say exactly what its ``vgpu-devices-allocated`` slot says."""
    env = allocation.for_resource(RESOURCE).envs
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(d.uuid for d in slot)
    for i, dev in enumerate(slot):
        assert env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == f"{dev.usedmem}m"
    assert f"CUDA_DEVICE_MEMORY_LIMIT_{len(slot)}" not in env
    assert env["CUDA_DEVICE_SM_LIMIT"] == str(slot[0].usedcores)
    cache = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    assert cache.parent == hook
    assert cache.suffix == ".cache"
    mounts = {m.container_path: m for m in allocation.mounts}
    region = mounts[str(hook)]
    assert region.host_path == str(hook / "containers" / f"{uid}_{allocation.container}")
    assert not region.read_only
    assert Path(region.host_path).is_dir(), "the region directory is created on the host"
    assert mounts[str(hook / "libvgpu.so")].read_only
    assert mounts["/etc/ld.so.preload"].host_path == str(hook / "ld.so.preload")


def allocated_slots(pod: dict[str, Any]) -> list[list[ContainerDevice]]:
    return decode_pod_devices(pod["metadata"]["annotations"][keys.DEVICES_ALLOCATED])


@pytest.fixture
async def gpu_stack(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    node_pool: NodePool,
    hami_scheduler: Callable[..., Any],
) -> AsyncIterator[GpuStack]:
    # Unix socket paths must stay short (about 100 bytes): a directory under /tmp, not tmp_path.
    workdir = Path(tempfile.mkdtemp(prefix="hamipy-gpu-", dir="/tmp"))
    webhook = await start_webhook(kube_client, namespace, workdir / "webhook")
    (extender,) = await start_extenders(kube_client)
    try:
        await use_extender(hami_scheduler, extender.url)
        standin, plugin = gpu_node_agents(
            workdir=workdir / "node",
            gpus=GPUS,
            kubeconfig=Path(devcluster.access.kubeconfig),
            native_build=NATIVE_BUILD,
        )
        node = f"{namespace}-gpu"
        await node_pool.add(NodeSpec(name=node, labels={"gpu-test": namespace}), agents=(standin, plugin))
        await standin.wait_registered(RESOURCE)
        yield GpuStack(kube_client, namespace, node, standin, plugin)
        assert not standin.errors, standin.errors
        report = await check_cluster(ApiClientKube(kube_client))
        assert report.ok, report.violations
    finally:
        await extender.stop()
        await stop_webhook(webhook)
        shutil.rmtree(workdir, ignore_errors=True)


async def test_node_registers_its_gpus(gpu_stack: GpuStack) -> None:
    node = await gpu_stack.core.read_node(gpu_stack.node, _request_timeout=API_TIMEOUT_S)
    devices = decode_node_devices(node.metadata.annotations[keys.NODE_REGISTER])
    assert [(d.id, d.index, d.count, d.devmem, d.type, d.numa, d.health) for d in devices] == [
        (GPUS[0].uuid, 0, 10, 81920, "NVIDIA A100-SXM4-80GB", 0, True),
        (GPUS[1].uuid, 1, 10, 81920, "NVIDIA A100-SXM4-80GB", 1, True),
    ]
    assert node.metadata.annotations[keys.NODE_HANDSHAKE].startswith("Reported_")
    assert node.status.capacity[RESOURCE] == "20"
    assert node.status.allocatable[RESOURCE] == "20"


async def test_container_env_and_mounts_match_its_allocation(gpu_stack: GpuStack) -> None:
    await gpu_stack.create(gpu_stack.pod_body("one", [gpu_container("main", mem=3000, cores=30)]))
    pod = await gpu_stack.served("one")
    allocation = await gpu_stack.allocation("one", "main")
    annotations = pod["metadata"]["annotations"]
    assert pod["spec"]["schedulerName"] == "hami-scheduler"  # the webhook routed it
    assert pod["spec"]["nodeName"] == gpu_stack.node
    (slot,) = allocated_slots(pod)
    assert [(d.usedmem, d.usedcores) for d in slot] == [(3000, 30)]
    assert_matches_slot(allocation, slot, gpu_stack.plugin.hook_path, pod["metadata"]["uid"])
    assert decode_pod_devices(annotations[keys.DEVICES_TO_ALLOCATE]) == [[]]
    node = await gpu_stack.core.read_node(gpu_stack.node, _request_timeout=API_TIMEOUT_S)
    assert keys.NODE_LOCK not in (node.metadata.annotations or {})

    async def running() -> bool:
        return (await gpu_stack.pod("one"))["status"].get("phase") == "Running"

    await wait_for(running, timeout=30, interval=0.1, what="pod one Running")


async def test_init_and_app_containers_each_get_their_own_slot(gpu_stack: GpuStack) -> None:
    body = gpu_stack.pod_body(
        "multi",
        [plain_container("sidecar"), gpu_container("app", mem=2000), gpu_container("pair", gpus=2, mem=1000)],
        init=[gpu_container("setup", mem=500)],
    )
    await gpu_stack.create(body)
    pod = await gpu_stack.served("multi")
    slots = allocated_slots(pod)
    assert [len(s) for s in slots] == [1, 0, 1, 2]  # setup, sidecar, app, pair
    uid = pod["metadata"]["uid"]
    for container, slot in (("setup", slots[0]), ("app", slots[2]), ("pair", slots[3])):
        assert_matches_slot(
            await gpu_stack.allocation("multi", container), slot, gpu_stack.plugin.hook_path, uid
        )
    assert len({d.uuid for d in slots[3]}) == 2, "two GPUs in one container are two distinct GPUs"
    assert ("multi", "sidecar") not in {(k.pod, k.container) for k in gpu_stack.standin.allocations}
    assert decode_pod_devices(pod["metadata"]["annotations"][keys.DEVICES_TO_ALLOCATE]) == [[], [], [], []]


async def test_ten_pods_at_once_all_succeed_with_distinct_allocations(gpu_stack: GpuStack) -> None:
    names = [f"burst-{i}" for i in range(10)]
    await asyncio.gather(
        *(gpu_stack.create(gpu_stack.pod_body(n, [gpu_container("main", mem=4000, cores=10)])) for n in names)
    )
    pods = await asyncio.gather(*(gpu_stack.served(n, timeout=120) for n in names))
    caches = set()
    for pod in pods:
        (slot,) = allocated_slots(pod)
        allocation = await gpu_stack.allocation(pod["metadata"]["name"], "main")
        assert_matches_slot(allocation, slot, gpu_stack.plugin.hook_path, pod["metadata"]["uid"])
        caches.add(allocation.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    assert len(caches) == 10
    device_ids = [
        d for key, a in gpu_stack.standin.allocations.items() if key.pod in names for d in a.device_ids
    ]
    assert len(set(device_ids)) == 10, "the kubelet's fake device IDs are not handed out twice"


async def test_kubelet_restart_reregisters_without_losing_allocations(gpu_stack: GpuStack) -> None:
    await gpu_stack.create(gpu_stack.pod_body("before", [gpu_container("main", mem=1000)]))
    await gpu_stack.served("before")
    first = await gpu_stack.allocation("before", "main")
    await gpu_stack.standin.restart()
    assert await gpu_stack.standin.wait_registered(RESOURCE, times=2) >= 2
    assert gpu_stack.standin.allocations[first.key] == first
    await gpu_stack.create(gpu_stack.pod_body("after", [gpu_container("main", mem=1000)]))
    await gpu_stack.served("after")
    second = await gpu_stack.allocation("after", "main")
    assert not set(second.device_ids) & set(first.device_ids)


async def test_unhealthy_gpu_is_reported_and_gets_no_new_pods(gpu_stack: GpuStack) -> None:
    sick = GPUS[1].uuid
    await gpu_stack.plugin.set_health(sick, healthy=False)
    await gpu_stack.standin.wait_until(
        lambda: all(not d.healthy for d in gpu_stack.standin.devices(RESOURCE) if d.id.startswith(sick)),
        timeout_s=30,
        what="the sick GPU's devices Unhealthy",
    )

    async def registered_sick() -> bool:
        node = await gpu_stack.core.read_node(gpu_stack.node, _request_timeout=API_TIMEOUT_S)
        devices = decode_node_devices(node.metadata.annotations[keys.NODE_REGISTER])
        return [d.health for d in devices] == [True, False] and node.status.allocatable[RESOURCE] == "10"

    await wait_for(registered_sick, timeout=30, interval=0.1, what="the node to register the GPU unhealthy")
    names = [f"after-sick-{i}" for i in range(3)]
    for name in names:
        await gpu_stack.create(gpu_stack.pod_body(name, [gpu_container("main", mem=1000)]))
    for name in names:
        (slot,) = allocated_slots(await gpu_stack.served(name))
        assert [d.uuid for d in slot] == [GPUS[0].uuid]
