"""Node faults in the middle of a burst of GPU pods: every container the kubelet creates is given
its own pod's slot, never another's, and no GPU is served past its capacity
(docs/device-plugin.md#what-the-guarantee-rests-on).

Three Deployments of differently sized slices (so that a slot served to the wrong pod shows in its
values as well as in its paths) run on one GPU node run by the real kubelet. The first is scaled up;
once the kubelet has created one of its containers the plugin is frozen (SIGSTOP), so the kubelet's
next Allocate waits unanswered and no further GPU container can start; the other two are scaled up
and every pod is bound; then the fault strikes, with the burst certainly unfinished:

- **the device plugin is killed** (SIGKILL) and started again, as its DaemonSet would: the
  kubelet's Allocates in flight fail and their pods fail admission (``UnexpectedAdmissionError``),
  while their allocation annotations still say ``allocating``;
- **the kubelet restarts** (and the plugin is thawed): the new kubelet takes every pod bound to the
  node in one batch and admits them in creation order, not in the order they were bound.

Pods that fail are visible (phase ``Failed`` with the kubelet's reason) and their ReplicaSets make
new ones, which are placed and served. Each fault runs twice (the Deployments scaled to zero and up
again between the rounds). Then every container the runtime recorded is checked against its own
pod's ``vgpu-devices-allocated`` slot: the pod UID in its region and limits-file mounts, the limits
file's text, its env; and the latest containers of the running pods against each GPU's capacity.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import builders
import pytest
from builders import container
from stack_support import NEEDS_REAL_KUBELET, GpuStack, allocated_slots

from hamipy.devcluster import wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.devcluster.real_kubelet import ContainerConfig
from hamipy.extender.invariant import check_cluster
from hamipy.kube.client import MERGE_PATCH, RawKube
from hamipy.protocol import ContainerDevice, keys
from hamipy.protocol.allocation_env import allocation_env, limits_file_text

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPU_MIB = 40960
GPUS = tuple(
    FakeGpu(f"GPU-eeeeeeee-0000-4000-8000-00000000000{i}", "NVIDIA A100-SXM4-40GB", GPU_MIB) for i in range(4)
)
SHAPES = {"small": (6000, 15), "medium": (8000, 20), "large": (10000, 25)}
"""Deployment -> (MiB, cores) of its pods' one-GPU slices: 12 pods (96000 MiB, 240 % cores) fit
the node's four GPUs (163840 MiB, 400 %) however the extender spreads them."""
REPLICAS = 4
FAULT_AFTER = 1
"""Containers the kubelet has created in a round when the plugin is frozen."""
SETTLE_S = 240.0
APPS = "/apis/apps/v1"


def deployment(stack: GpuStack, name: str, replicas: int) -> dict[str, Any]:
    mib, cores = SHAPES[name]
    spec = {
        "nodeSelector": {"gpu-test": stack.namespace},
        "terminationGracePeriodSeconds": 0,
        "containers": [container("main", gpu=1, gpumem=mib, gpucores=cores)],
    }
    return builders.deployment(name, replicas, spec)


async def scale(stack: GpuStack, replicas: int, names: Iterable[str] = SHAPES) -> None:
    kube = RawKube(stack.api)
    base = f"{APPS}/namespaces/{stack.namespace}/deployments"
    for name in names:
        await kube.request(
            "PATCH", f"{base}/{name}/scale", body={"spec": {"replicas": replicas}}, content_type=MERGE_PATCH
        )


async def all_pods(stack: GpuStack) -> list[dict[str, Any]]:
    listed = await RawKube(stack.api).request("GET", f"/api/v1/namespaces/{stack.namespace}/pods")
    pods: list[dict[str, Any]] = listed["items"]
    return pods


def active(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        p
        for p in pods
        if p["status"].get("phase") not in ("Failed", "Succeeded")
        and not p["metadata"].get("deletionTimestamp")
    ]


async def settled(stack: GpuStack, replicas: int) -> list[dict[str, Any]]:
    """The running pods once every Deployment has exactly ``replicas`` of them, each served."""

    async def done() -> list[dict[str, Any]] | None:
        live = active(await all_pods(stack))
        running = [
            p
            for p in live
            if p["status"].get("phase") == "Running"
            and (p["metadata"].get("annotations") or {}).get(keys.BIND_PHASE) == "success"
        ]
        return running if len(live) == len(running) == replicas * len(SHAPES) else None

    found: list[dict[str, Any]] | None = await wait_for(
        done, timeout=SETTLE_S, interval=0.5, what=f"{replicas} running replicas of each Deployment"
    )
    assert found is not None
    return found


async def emptied(stack: GpuStack) -> None:
    async def none_left() -> bool:
        return not active(await all_pods(stack))

    await wait_for(none_left, timeout=SETTLE_S, interval=0.5, what="every replica gone")


async def all_bound(stack: GpuStack, count: int) -> None:
    async def bound() -> bool:
        live = active(await all_pods(stack))
        return len(live) == count and all(p["spec"].get("nodeName") for p in live)

    await wait_for(bound, timeout=SETTLE_S, interval=0.2, what=f"{count} pods bound")


async def created_at_least(stack: GpuStack, count: int) -> None:
    def enough() -> bool:
        return len(stack.kubelet_node.kubelet.containers()) >= count

    await wait_for(enough, timeout=SETTLE_S, interval=0.05, what=f"the kubelet to create {count} containers")


def served(config: ContainerConfig) -> list[ContainerDevice]:
    """What one created container was given, from its env (one GPU per container here)."""
    env = config.envs
    (uuid,) = env["NVIDIA_VISIBLE_DEVICES"].split(",")
    mib = int(env["CUDA_DEVICE_MEMORY_LIMIT_0"].removesuffix("m"))
    return [ContainerDevice(uuid, "NVIDIA", mib, int(env["CUDA_DEVICE_SM_LIMIT"]))]


def wrong_slots(configs: list[ContainerConfig], pods: dict[str, dict[str, Any]], hook: Path) -> list[str]:
    """Every created container whose mounts, limits file or env are not its own pod's slot."""
    found = []
    for config in configs:
        pod = pods[config.pod_uid]
        (own,) = allocated_slots(pod)
        own_dir = hook / "containers" / f"{config.pod_uid}_{config.container}"
        region = config.mount(str(hook)).host_path
        limits = config.mount(str(hook / "limits"))
        text = Path(limits.host_path).read_text() if Path(limits.host_path).exists() else "(missing)"
        expected = limits_file_text(
            allocation_env(
                own, cache_id=Path(config.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).stem, hook_path=str(hook)
            )
        )
        problems = [
            what
            for what, bad in (
                (f"region dir {region}", region != str(own_dir)),
                (
                    f"limits file {limits.host_path}",
                    limits.host_path != str(own_dir / "limits") or not limits.read_only,
                ),
                (f"limits {text!r}", text != expected),
                (f"env {served(config)}", served(config) != own),
            )
            if bad
        ]
        if problems:
            found.append(
                f"{config.pod}/{config.container}#{config.attempt} (own slot {own}): {', '.join(problems)}"
            )
    return found


def over_capacity(configs: list[ContainerConfig], running: list[dict[str, Any]], hook: Path) -> list[str]:
    """GPUs whose running containers were served more memory or cores than the GPU has."""
    live = {p["metadata"]["uid"] for p in running}
    latest: dict[tuple[str, str], ContainerConfig] = {}
    for config in configs:
        if config.pod_uid in live:
            latest[(config.pod_uid, config.container)] = config
    memory: collections.Counter[str] = collections.Counter()
    cores: collections.Counter[str] = collections.Counter()
    for config in latest.values():
        for dev in served(config):
            memory[dev.uuid] += dev.usedmem
            cores[dev.uuid] += dev.usedcores
    return [
        f"{uuid}: {memory[uuid]} MiB, {cores[uuid]} % cores"
        for uuid in memory
        if memory[uuid] > GPU_MIB or cores[uuid] > 100
    ]


async def run_rounds(stack: GpuStack, fault: Callable[[], Awaitable[None]]) -> None:
    """Two rounds of a burst with ``fault`` striking mid-burst."""
    kube = RawKube(stack.api)
    base = f"{APPS}/namespaces/{stack.namespace}/deployments"
    for name in SHAPES:
        await kube.request("POST", base, body=deployment(stack, name, 0))
    first, *rest = SHAPES
    for _ in range(2):
        before = len(stack.kubelet_node.kubelet.containers())
        await scale(stack, REPLICAS, [first])
        await created_at_least(stack, before + FAULT_AFTER)
        stack.plugin.pause()
        frozen_at = len(stack.kubelet_node.kubelet.containers())
        await scale(stack, REPLICAS, rest)
        await all_bound(stack, REPLICAS * len(SHAPES))
        await fault()
        stack.plugin.resume()  # the kubelet fault leaves the plugin frozen; a killed one is new
        running = await settled(stack, REPLICAS)
        # The fault struck mid-burst: most containers were created after it.
        assert len(stack.kubelet_node.kubelet.containers()) >= before + REPLICAS * len(SHAPES) > frozen_at
        pods = {p["metadata"]["uid"]: p for p in await all_pods(stack)}
        # The containers of this round's pods (those of the round before are gone with their pods).
        configs = [c for c in stack.kubelet_node.kubelet.containers() if c.pod_uid in pods]
        hook = stack.plugin.hook_path
        assert wrong_slots(configs, pods, hook) == []
        assert over_capacity(configs, running, hook) == []
        report = await check_cluster(kube)
        assert report.ok, report.violations
        await scale(stack, 0)
        await emptied(stack)
    failed = [p for p in await all_pods(stack) if p["status"].get("phase") == "Failed"]
    for pod in failed:  # visibly: the kubelet's reason is on the pod
        assert pod["status"].get("reason") or pod["status"].get("message"), pod["status"]


async def test_a_device_plugin_killed_mid_burst_serves_every_container_its_own_slot(
    gpu_stack: GpuStack,
) -> None:
    async def kill_plugin() -> None:
        await gpu_stack.plugin.kill()
        await gpu_stack.plugin.start(gpu_stack.kubelet_node)

    await run_rounds(gpu_stack, kill_plugin)


async def test_a_kubelet_restarted_mid_burst_serves_every_container_its_own_slot(gpu_stack: GpuStack) -> None:
    await run_rounds(gpu_stack, gpu_stack.kubelet_node.restart_kubelet)
