"""The whole path of a GPU pod: webhook -> kube-scheduler -> extender ->
bind -> the real kubelet's device manager -> the real device plugin process over the fake NVML ->
Allocate -> the container the kubelet creates.

Each test runs one GPU node (``stack_support.gpu_node``: the real kubelet v1.34 over the fake
container runtime, and a ``hamipy-device-plugin`` process), the webhook and one extender in this
process, and the real control plane. What a container gets is read from the runtime's record of the
kubelet's CreateContainer (its envs and mounts) and from the kubelet's device checkpoint. Pods are
created without a scheduler name: the webhook routes them; a tenant's forged pods (docs/security.md) are
bound by ``spec.nodeName`` and carry allocation annotations of their own.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import builders
import pytest
from builders import container
from stack_support import (
    NEEDS_REAL_KUBELET,
    RESOURCE,
    GpuStack,
    allocated_slots,
)

from hamipy.devcluster import API_TIMEOUT_S, wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.devcluster.kubeobjects import create_namespace, delete_namespace
from hamipy.devcluster.real_kubelet import ContainerConfig
from hamipy.device_plugin.devices import gpu_of
from hamipy.protocol import ContainerDevice, decode_node_devices, decode_pod_devices, keys
from hamipy.protocol.allocation_env import allocation_env, limits_file_text

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPUS = (
    FakeGpu("GPU-aaaaaaaa-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-80GB", 81920, numa=0),
    FakeGpu("GPU-aaaaaaaa-0000-4000-8000-000000000001", "NVIDIA A100-SXM4-80GB", 81920, numa=1),
)


def assert_matches_slot(
    config: ContainerConfig, device_ids: list[str], slot: list[ContainerDevice], hook: Path, uid: str
) -> None:
    """The container the kubelet created has exactly the env and mounts its
    ``vgpu-devices-allocated`` slot says, and the kubelet's device IDs for it lie on the slot's GPUs
    (GetPreferredAllocation steered them)."""
    assert (config.pod_uid, len(device_ids)) == (uid, len(slot))
    assert sorted(gpu_of(d) for d in device_ids) == sorted(d.uuid for d in slot)
    env = config.envs
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(d.uuid for d in slot)
    for i, dev in enumerate(slot):
        assert env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == f"{dev.usedmem}m"
    assert f"CUDA_DEVICE_MEMORY_LIMIT_{len(slot)}" not in env
    assert env["CUDA_DEVICE_SM_LIMIT"] == str(slot[0].usedcores)
    cache = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    assert cache.parent == hook
    assert cache.suffix == ".cache"
    region = config.mount(str(hook))
    assert region.host_path == str(hook / "containers" / f"{uid}_{config.container}")
    assert not region.read_only
    assert Path(region.host_path).is_dir(), "the region directory is created on the host"
    assert config.mount(str(hook / "libvgpu.so")).read_only
    assert config.mount("/etc/ld.so.preload").host_path == str(hook / "ld.so.preload")
    # The limits the interposer enforces: the plugin's env, read-only beside the interposer.
    limits = config.mount(str(hook / "limits"))
    assert (limits.host_path, limits.read_only) == (f"{region.host_path}/limits", True)
    plugin_env = allocation_env(slot, cache_id=cache.stem, hook_path=str(hook))
    assert Path(limits.host_path).read_text() == limits_file_text(plugin_env)


async def assert_container_matches(
    stack: GpuStack, pod: dict[str, Any], container: str, slot: list[ContainerDevice]
) -> ContainerConfig:
    uid = pod["metadata"]["uid"]
    config = await stack.container(pod["metadata"]["name"], container)
    assert_matches_slot(config, stack.device_ids(uid, container), slot, stack.plugin.hook_path, uid)
    return config


async def test_node_registers_its_gpus(gpu_stack: GpuStack) -> None:
    async def advertised() -> Any:
        # The kubelet writes the capacity after the plugin's ListAndWatch: not at once.
        node = await gpu_stack.core.read_node(gpu_stack.node, _request_timeout=API_TIMEOUT_S)
        return node if (node.status.capacity or {}).get(RESOURCE) not in (None, "0") else None

    node = await wait_for(advertised, timeout=30, interval=0.1, what="the node advertising its GPUs")
    devices = decode_node_devices(node.metadata.annotations[keys.NODE_REGISTER])
    assert [(d.id, d.index, d.count, d.devmem, d.type, d.numa, d.health) for d in devices] == [
        (GPUS[0].uuid, 0, 10, 81920, "NVIDIA A100-SXM4-80GB", 0, True),
        (GPUS[1].uuid, 1, 10, 81920, "NVIDIA A100-SXM4-80GB", 1, True),
    ]
    assert node.metadata.annotations[keys.NODE_HANDSHAKE].startswith("Reported_")
    # Our marker is the report itself: the extender binds here without the node lock.
    assert (
        node.metadata.annotations[keys.DEVICE_PLUGIN_MARKER] == node.metadata.annotations[keys.NODE_HANDSHAKE]
    )
    assert node.status.capacity[RESOURCE] == "20"
    assert node.status.allocatable[RESOURCE] == "20"


async def test_container_env_and_mounts_match_its_allocation(gpu_stack: GpuStack) -> None:
    await gpu_stack.create(gpu_stack.pod_body("one", [container("main", gpu=1, gpumem=3000, gpucores=30)]))
    pod = await gpu_stack.served("one")
    annotations = pod["metadata"]["annotations"]
    assert pod["spec"]["schedulerName"] == "hami-scheduler"  # the webhook routed it
    assert pod["spec"]["nodeName"] == gpu_stack.node
    (slot,) = allocated_slots(pod)
    assert [(d.usedmem, d.usedcores) for d in slot] == [(3000, 30)]
    await assert_container_matches(gpu_stack, pod, "main", slot)
    assert decode_pod_devices(annotations[keys.DEVICES_TO_ALLOCATE]) == [[]]
    node = await gpu_stack.core.read_node(gpu_stack.node, _request_timeout=API_TIMEOUT_S)
    assert keys.NODE_LOCK not in (node.metadata.annotations or {})
    await gpu_stack.running("one")


async def test_init_and_app_containers_each_get_their_own_slot(gpu_stack: GpuStack) -> None:
    body = gpu_stack.pod_body(
        "multi",
        [container("sidecar"), container("app", gpu=1, gpumem=2000), container("pair", gpu=2, gpumem=1000)],
        # Runs to completion (the fake runtime exits a container whose command is `true`).
        init=[container("setup", gpu=1, gpumem=500, command=["true"])],
    )
    await gpu_stack.create(body)
    pod = await gpu_stack.served("multi")
    slots = allocated_slots(pod)
    assert [len(s) for s in slots] == [1, 0, 1, 2]  # setup, sidecar, app, pair
    for name, slot in (("setup", slots[0]), ("app", slots[2]), ("pair", slots[3])):
        await assert_container_matches(gpu_stack, pod, name, slot)
    assert len({d.uuid for d in slots[3]}) == 2, "two GPUs in one container are two distinct GPUs"
    sidecar = await gpu_stack.container("multi", "sidecar")
    assert gpu_stack.device_ids(pod["metadata"]["uid"], "sidecar") == []
    assert "NVIDIA_VISIBLE_DEVICES" not in sidecar.envs
    assert decode_pod_devices(pod["metadata"]["annotations"][keys.DEVICES_TO_ALLOCATE]) == [[], [], [], []]
    await gpu_stack.running("multi")


async def test_ten_pods_at_once_all_succeed_with_distinct_allocations(gpu_stack: GpuStack) -> None:
    names = [f"burst-{i}" for i in range(10)]
    await asyncio.gather(
        *(
            gpu_stack.create(gpu_stack.pod_body(n, [container("main", gpu=1, gpumem=4000, gpucores=10)]))
            for n in names
        )
    )
    pods = await asyncio.gather(*(gpu_stack.served(n, timeout=120) for n in names))
    caches = set()
    device_ids = []
    for pod in pods:
        (slot,) = allocated_slots(pod)
        config = await assert_container_matches(gpu_stack, pod, "main", slot)
        caches.add(config.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
        device_ids += gpu_stack.device_ids(pod["metadata"]["uid"], "main")
    assert len(caches) == 10
    assert len(set(device_ids)) == 10, "the kubelet's device IDs are not handed out twice"


async def test_kubelet_restart_reregisters_without_losing_allocations(gpu_stack: GpuStack) -> None:
    registered = "hamipy_device_plugin_registrations_total"
    await gpu_stack.create(gpu_stack.pod_body("before", [container("main", gpu=1, gpumem=1000)]))
    before = await gpu_stack.served("before")
    await gpu_stack.running("before")
    uid = before["metadata"]["uid"]
    first = gpu_stack.device_ids(uid, "main")
    registrations = await gpu_stack.plugin_metric(registered, result="success")
    await gpu_stack.kubelet_node.restart_kubelet()

    async def registered_again() -> bool:
        return await gpu_stack.plugin_metric(registered, result="success") > registrations

    # The restarted kubelet wiped the plugin's socket: the plugin serves and registers again.
    await wait_for(registered_again, timeout=60, interval=0.2, what="the plugin to register again")
    assert gpu_stack.device_ids(uid, "main") == first, "the kubelet's checkpoint kept the assignment"
    await gpu_stack.create(gpu_stack.pod_body("after", [container("main", gpu=1, gpumem=1000)]))
    after = await gpu_stack.served("after")
    (slot,) = allocated_slots(after)
    await assert_container_matches(gpu_stack, after, "main", slot)
    assert not set(gpu_stack.device_ids(after["metadata"]["uid"], "main")) & set(first)
    # The running pod was neither restarted nor served again.
    assert (await gpu_stack.pod("before"))["status"]["phase"] == "Running"
    assert [c.attempt for c in gpu_stack.kubelet_node.kubelet.containers() if c.pod == "before"] == [0]
    assert allocated_slots(await gpu_stack.pod("before")) == allocated_slots(before)


async def test_unhealthy_gpu_is_reported_and_gets_no_new_pods(gpu_stack: GpuStack) -> None:
    sick = GPUS[1].uuid
    await gpu_stack.plugin.set_health(sick, healthy=False)

    async def registered_sick() -> bool:
        node = await gpu_stack.core.read_node(gpu_stack.node, _request_timeout=API_TIMEOUT_S)
        devices = decode_node_devices(node.metadata.annotations[keys.NODE_REGISTER])
        return [d.health for d in devices] == [True, False] and node.status.allocatable[RESOURCE] == "10"

    await wait_for(registered_sick, timeout=30, interval=0.1, what="the node to register the GPU unhealthy")
    names = [f"after-sick-{i}" for i in range(3)]
    for name in names:
        await gpu_stack.create(gpu_stack.pod_body(name, [container("main", gpu=1, gpumem=1000)]))
    for name in names:
        (slot,) = allocated_slots(await gpu_stack.served(name))
        assert [d.uuid for d in slot] == [GPUS[0].uuid]


def forged_pod(
    name: str, node: str, *containers: dict[str, Any], slot: list[ContainerDevice]
) -> dict[str, Any]:
    """A tenant's pod bound to ``node`` by ``spec.nodeName`` (no scheduler involved) with allocation
    annotations of its own making: ``slot`` for its first container, waiting to be served."""
    forged = [slot]
    return builders.pod(
        name,
        *containers,
        node_name=node,
        terminationGracePeriodSeconds=0,
        annotations=builders.allocation(
            allocated=forged, to_allocate=forged, node=node, phase="allocating", bind_time=int(time.time())
        ),
    )


async def test_a_pod_asking_no_gpu_never_takes_a_gpu_pods_slot(gpu_stack: GpuStack) -> None:
    # The hijack: a pod asking no GPU, forged with a 1 MiB, 0-core slot; the next GPU container on
    # the node must be served its own slot, not this one.
    hijack = forged_pod(
        "hijack", gpu_stack.node, container("main"), slot=[ContainerDevice(GPUS[0].uuid, "NVIDIA", 1, 0)]
    )
    await gpu_stack.create(hijack)

    async def hijack_running() -> bool:
        phase: str | None = (await gpu_stack.pod("hijack"))["status"].get("phase")
        return phase == "Running"

    # Admitted without Allocate (it asks for no device), and in the plugin's view before the next pod.
    await wait_for(hijack_running, timeout=30, interval=0.1, what="the hijack pod admitted")
    await gpu_stack.create(gpu_stack.pod_body("legit", [container("main", gpu=1, gpumem=30000, gpucores=40)]))
    pod = await gpu_stack.served("legit")
    (slot,) = allocated_slots(pod)
    assert [(d.usedmem, d.usedcores) for d in slot] == [(30000, 40)]
    config = await assert_container_matches(gpu_stack, pod, "main", slot)
    assert config.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "30000m"
    assert config.envs["CUDA_DEVICE_SM_LIMIT"] == "40"
    hijack_config = await gpu_stack.container("hijack", "main")
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in hijack_config.envs
    left = (await gpu_stack.pod("hijack"))["metadata"]["annotations"]
    assert left == hijack["metadata"]["annotations"], "the hijack pod is neither served nor touched"


async def test_a_gpu_pod_another_scheduler_placed_is_refused_not_served(
    gpu_stack: GpuStack, kube_client: Any
) -> None:
    # The steal, from a namespace the webhook does not watch: the API server names the
    # default scheduler, and the pod is bound by spec.nodeName with a slot of its own making.
    other = await create_namespace(kube_client)
    try:
        steal = forged_pod(
            "steal",
            gpu_stack.node,
            container("main", gpu=1, gpumem=30000, gpucores=40),
            slot=[ContainerDevice(GPUS[0].uuid, "NVIDIA", 30000, 40)],
        )
        core: Any = gpu_stack.core
        await core.create_namespaced_pod(other, steal, _request_timeout=API_TIMEOUT_S)

        async def rejected() -> dict[str, Any] | None:
            read = await gpu_stack.core.read_namespaced_pod("steal", other, _request_timeout=API_TIMEOUT_S)
            out: dict[str, Any] = gpu_stack.api.sanitize_for_serialization(read)
            return out if out["status"].get("phase") == "Failed" else None

        failed = await wait_for(rejected, timeout=30, interval=0.1, what="the steal pod rejected")
        assert failed["status"]["reason"] == "UnexpectedAdmissionError"
        assert "schedulerName is 'default-scheduler', not 'hami-scheduler'" in failed["status"]["message"]
        assert failed["metadata"]["annotations"][keys.BIND_PHASE] == "failed"
        assert gpu_stack.device_ids(failed["metadata"]["uid"], "main") == []
        assert gpu_stack.kubelet_node.kubelet.container(other, "steal", "main") is None
    finally:
        await delete_namespace(kube_client, other)
    # The node still serves our pods.
    await gpu_stack.create(gpu_stack.pod_body("after", [container("main", gpu=1, gpumem=30000, gpucores=40)]))
    (slot,) = allocated_slots(await gpu_stack.served("after"))
    assert [(d.usedmem, d.usedcores) for d in slot] == [(30000, 40)]
