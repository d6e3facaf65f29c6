"""Allocate's bookkeeping against a fake API: success, lock release, failures reported on the pod."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import builders
import pytest
from allocator_support import dev, waiting_pod
from fake_kube import FakeKube
from plugin_fakes import NODE, PODS, FakePodResources, node_kube

from hamipy.device_plugin.allocator import Allocator
from hamipy.device_plugin.errors import AllocateError
from hamipy.device_plugin.kube import NodeKube, node_pods_informer
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.errors import KubeError
from hamipy.kube.informer import InformerSettings
from hamipy.kube.resources import node_path, pod_path
from hamipy.protocol import keys
from hamipy.protocol.config import load_config
from hamipy.protocol.node_lock import NodeLock, format_node_lock


def fake_api(pods: list[dict[str, Any]], *, lock_owner: str | None = None) -> FakeKube:
    api = node_kube(*pods)
    if lock_owner is not None:
        lock = NodeLock(time=datetime.now(UTC), namespace="ns", name=lock_owner)
        api.node(NODE)["metadata"]["annotations"][keys.NODE_LOCK] = format_node_lock(lock)
    return api


def pod(name: str, to_allocate: str, *, bind_time: int = 1) -> dict[str, Any]:
    """``builders.allocating_pod`` on NODE: containers "main" and "second", each asking for what its
    slot of ``to_allocate`` holds, all of it still to serve."""
    return builders.allocating_pod(
        name, "main", "second", node=NODE, allocated=to_allocate, to_allocate=to_allocate, bind_time=bind_time
    )


async def make(
    api: FakeKube, tmp_path: Path, *, cached: bool = True, log: io.StringIO | None = None
) -> tuple[Allocator, Telemetry]:
    config = load_config(f"nvidia:\n  hookPath: {tmp_path}/vgpu\n")
    telemetry = Telemetry.create(stream=log or io.StringIO())
    cache = PodCache(node_pods_informer(api, NODE, logger=telemetry.logger, settings=InformerSettings()))
    if cached:
        await cache.informer.list_once()
        api.requests.clear()
    allocator = Allocator(
        api=NodeKube(api, node_name=NODE),
        pods=cache,
        kubelet=FakePodResources(api).pods,
        nvidia=config.nvidia,
        node_settings=config.for_node(NODE),
        telemetry=telemetry,
        cache_id=lambda: "c0ffee",
    )
    return allocator, telemetry


def annotations_of(api: FakeKube, name: str) -> dict[str, str]:
    result: dict[str, str] = api.pod("ns", name)["metadata"]["annotations"]
    return result


async def test_two_containers_are_served_in_order_then_the_pod_succeeds(tmp_path: Path) -> None:
    api = fake_api([pod("p", "GPU-A,NVIDIA,1000,10:;GPU-B,NVIDIA,2000,20:;")], lock_owner="p")
    allocator, _ = await make(api, tmp_path)
    (first,) = await allocator.allocate([["GPU-A-0"]])
    assert first.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-A"
    assert first.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == f"{tmp_path}/vgpu/c0ffee.cache"
    assert (tmp_path / "vgpu" / "containers" / "uid-ns-p_main").is_dir()
    assert annotations_of(api, "p")[keys.BIND_PHASE] == "allocating"
    assert keys.NODE_LOCK in api.node(NODE)["metadata"]["annotations"], (
        "the lock stays until the pod is served"
    )
    (second,) = await allocator.allocate([["GPU-B-3"]])
    assert second.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-B"
    assert second.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
    assert annotations_of(api, "p")[keys.BIND_PHASE] == "success"
    assert annotations_of(api, "p")[keys.DEVICES_TO_ALLOCATE] == ";;"
    assert keys.NODE_LOCK not in api.node(NODE)["metadata"]["annotations"]
    assert api.calls.count(("GET", PODS)) == 0, "served from the cache"


async def test_hamis_list_without_the_init_containers_empty_slot_serves_main_as_itself(
    tmp_path: Path,
) -> None:
    # HAMi's scheduler writes init(no GPU) + main(GPU) as one slot: it is main's (main's region
    # directory and limits file), not the init container's.
    hami = waiting_pod(
        "p",
        builders.container("main", gpu=1),
        init=[builders.container("setup")],
        slots=[[dev("GPU-A", 1000, 10)]],
    )
    api = fake_api([hami], lock_owner="p")
    allocator, _ = await make(api, tmp_path)
    (served,) = await allocator.allocate([["GPU-A-0"]])
    assert served.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-A"
    assert (tmp_path / "vgpu" / "containers" / "uid-ns-p_main").is_dir()
    assert not (tmp_path / "vgpu" / "containers" / "uid-ns-p_setup").exists()
    assert served.limits_path == f"{tmp_path}/vgpu/containers/uid-ns-p_main/limits"
    assert annotations_of(api, "p")[keys.BIND_PHASE] == "success"


async def test_another_pods_lock_is_left_alone(tmp_path: Path) -> None:
    api = fake_api([pod("p", "GPU-A,NVIDIA,1000,10:;;")], lock_owner="someone-else")
    allocator, _ = await make(api, tmp_path)
    await allocator.allocate([["GPU-A-0"]])
    assert annotations_of(api, "p")[keys.BIND_PHASE] == "success"
    assert keys.NODE_LOCK in api.node(NODE)["metadata"]["annotations"]


async def test_lock_release_retries_a_lost_race(tmp_path: Path) -> None:
    api = fake_api([pod("p", "GPU-A,NVIDIA,1000,10:;;")], lock_owner="p")
    api.race(node_path(NODE), times=2)
    allocator, _ = await make(api, tmp_path)
    await allocator.allocate([["GPU-A-0"]])
    assert keys.NODE_LOCK not in api.node(NODE)["metadata"]["annotations"]


async def test_a_pod_the_cache_has_not_seen_is_found_by_a_fresh_list(tmp_path: Path) -> None:
    api = fake_api([pod("late", "GPU-A,NVIDIA,1000,10:;;")])
    allocator, _ = await make(api, tmp_path, cached=False)
    (allocation,) = await allocator.allocate([["GPU-A-0"]])
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-A"
    assert api.calls.count(("GET", PODS)) == 1


async def test_no_waiting_pod_is_a_clear_error(tmp_path: Path) -> None:
    api = fake_api([pod("p", "GPU-A,NVIDIA,1000,10:GPU-B,NVIDIA,1000,10:;;")])
    allocator, telemetry = await make(api, tmp_path)
    with pytest.raises(
        AllocateError, match="no pod the kubelet is admitting on node n1 waits for a container of 1 device"
    ):
        await allocator.allocate([["GPU-A-0"]])
    samples = telemetry.metrics.registry.get_sample_value(
        "hamipy_device_plugin_allocations_total", {"result": "failed", "reason": "NoPendingPod"}
    )
    assert samples == 1
    assert annotations_of(api, "p")[keys.BIND_PHASE] == "allocating", "a pod that did not match is untouched"


async def test_malformed_pod_is_marked_failed_and_its_lock_released(tmp_path: Path) -> None:
    api = fake_api([pod("bad", "GPU-A,NVIDIA,lots,10:;;")], lock_owner="bad")
    allocator, _ = await make(api, tmp_path)
    with pytest.raises(AllocateError):
        await allocator.allocate([["GPU-A-0"]])
    assert annotations_of(api, "bad")[keys.BIND_PHASE] == "failed"
    assert keys.NODE_LOCK not in api.node(NODE)["metadata"]["annotations"]


async def test_an_unbuildable_allocation_fails_the_pod(tmp_path: Path) -> None:
    # 0 MiB would read as "no limit" in the interposer: refused, and the pod is told.
    api = fake_api([pod("zero", "GPU-A,NVIDIA,0,10:;;")])
    allocator, _ = await make(api, tmp_path)
    with pytest.raises(AllocateError, match="zero"):
        await allocator.allocate([["GPU-A-0"]])
    assert annotations_of(api, "zero")[keys.BIND_PHASE] == "failed"


async def test_an_api_error_fails_the_allocate_and_the_pod_with_its_cause(tmp_path: Path) -> None:
    api = fake_api([pod("p", "GPU-A,NVIDIA,1000,10:;;")], lock_owner="p")
    api.fail(
        KubeError("PATCH pod: HTTP 500: etcd is busy", status=500), "PATCH", pod_path("ns", "p"), times=1
    )
    allocator, _ = await make(api, tmp_path)
    with pytest.raises(AllocateError, match="pod ns/p: PATCH pod: HTTP 500: etcd is busy"):
        await allocator.allocate([["GPU-A-0"]])
    assert annotations_of(api, "p")[keys.BIND_PHASE] == "failed"
    assert keys.NODE_LOCK not in api.node(NODE)["metadata"]["annotations"]


async def test_a_pod_made_again_under_its_allocate_is_left_alone(tmp_path: Path) -> None:
    # Deleted and created again under its name while its container was being served: every write
    # names the served pod's uid, so the new pod is not touched.
    api = fake_api([pod("p", "GPU-A,NVIDIA,1000,10:;;")], lock_owner="p")
    allocator, _ = await make(api, tmp_path)
    again = pod("p", "GPU-A,NVIDIA,1000,10:;;")
    again["metadata"]["uid"] = "uid-ns-p-again"

    def recreate(method: str, path: str, body: Any) -> None:
        if method == "PATCH" and path == pod_path("ns", "p"):
            api.on_request = None
            api.add(again)

    api.on_request = recreate
    with pytest.raises(AllocateError, match=r"pod ns/p: .*HTTP 409"):
        await allocator.allocate([["GPU-A-0"]])
    assert annotations_of(api, "p") == again["metadata"]["annotations"]


async def test_a_lock_every_release_loses_is_left_to_expire(tmp_path: Path) -> None:
    api = fake_api([pod("p", "GPU-A,NVIDIA,1000,10:;;")], lock_owner="p")
    api.race(node_path(NODE), times=100)
    log = io.StringIO()
    allocator, _ = await make(api, tmp_path, log=log)
    await allocator.allocate([["GPU-A-0"]])
    assert annotations_of(api, "p")[keys.BIND_PHASE] == "success"
    assert keys.NODE_LOCK in api.node(NODE)["metadata"]["annotations"]
    assert "node lock not released" in log.getvalue()
