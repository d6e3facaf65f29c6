"""Allocate's bookkeeping against a fake API: success, lock release, failures reported on the pod."""

from __future__ import annotations

import copy
import io
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest

from hamipy.device_plugin.allocator import Allocator
from hamipy.device_plugin.errors import AllocateError, Conflict
from hamipy.device_plugin.kube import NodeApi
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.protocol import keys
from hamipy.protocol.config import load_config
from hamipy.protocol.node_lock import NodeLock, format_node_lock

NODE = "n1"


class FakeApi:
    """The calls Allocator makes, on dicts; counts writes and can lose one resourceVersion race."""

    node_name = NODE

    def __init__(self, pods: list[dict[str, Any]], *, lock_owner: str | None = None) -> None:
        self.pods = {p["metadata"]["uid"]: p for p in pods}
        self.node: dict[str, Any] = {"metadata": {"name": NODE, "resourceVersion": "1", "annotations": {}}}
        if lock_owner is not None:
            lock = NodeLock(time=datetime.now(UTC), namespace="ns", name=lock_owner)
            self.node["metadata"]["annotations"][keys.NODE_LOCK] = format_node_lock(lock)
        self.version = 10
        self.conflicts = 0
        self.lists = 0

    async def get_node(self) -> dict[str, Any]:
        return copy.deepcopy(self.node)

    async def node_pods(self) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return copy.deepcopy(list(self.pods.values())), str(self.version)

    async def patch_node_annotations(
        self, annotations: dict[str, str | None], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        if self.conflicts:
            self.conflicts -= 1
            self.node["metadata"]["resourceVersion"] = str(int(self.node["metadata"]["resourceVersion"]) + 1)
            raise Conflict("lost the race", status=409)
        assert resource_version == self.node["metadata"]["resourceVersion"]
        current = self.node["metadata"]["annotations"]
        for key, value in annotations.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        return copy.deepcopy(self.node)

    async def patch_pod_annotations(
        self, namespace: str, name: str, uid: str, annotations: dict[str, str | None]
    ) -> dict[str, Any]:
        pod = self.pods[uid]
        pod["metadata"]["annotations"].update(annotations)
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(pod)


def pod(name: str, to_allocate: str, *, bind_time: int = 1) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": "5",
            "annotations": {
                keys.BIND_PHASE: "allocating",
                keys.BIND_TIME: str(bind_time),
                keys.DEVICES_TO_ALLOCATE: to_allocate,
                keys.DEVICES_ALLOCATED: to_allocate,
            },
        },
        "spec": {"nodeName": NODE, "containers": [{"name": "main"}, {"name": "second"}]},
    }


def make(api: FakeApi, tmp_path: Path, *, cached: bool = True) -> tuple[Allocator, Telemetry]:
    config = load_config(f"nvidia:\n  hookPath: {tmp_path}/vgpu\n")
    telemetry = Telemetry(log_stream=io.StringIO())
    node_api = cast(NodeApi, api)
    cache = PodCache(node_api, telemetry)
    if cached:
        cache.replace(copy.deepcopy(list(api.pods.values())))
    allocator = Allocator(
        api=node_api,
        pods=cache,
        nvidia=config.nvidia,
        node_settings=config.for_node(NODE),
        telemetry=telemetry,
        cache_id=lambda: "c0ffee",
    )
    return allocator, telemetry


def annotations(api: FakeApi, name: str) -> dict[str, str]:
    result: dict[str, str] = api.pods[f"uid-{name}"]["metadata"]["annotations"]
    return result


async def test_two_containers_are_served_in_order_then_the_pod_succeeds(tmp_path: Path) -> None:
    api = FakeApi([pod("p", "GPU-A,NVIDIA,1000,10:;GPU-B,NVIDIA,2000,20:;")], lock_owner="p")
    allocator, _ = make(api, tmp_path)
    (first,) = await allocator.allocate([1])
    assert first.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-A"
    assert first.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == f"{tmp_path}/vgpu/c0ffee.cache"
    assert (tmp_path / "vgpu" / "containers" / "uid-p_main").is_dir()
    assert annotations(api, "p")[keys.BIND_PHASE] == "allocating"
    assert keys.NODE_LOCK in api.node["metadata"]["annotations"], "the lock stays until the pod is served"
    (second,) = await allocator.allocate([1])
    assert second.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-B"
    assert second.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
    assert annotations(api, "p")[keys.BIND_PHASE] == "success"
    assert annotations(api, "p")[keys.DEVICES_TO_ALLOCATE] == ";;"
    assert keys.NODE_LOCK not in api.node["metadata"]["annotations"]
    assert api.lists == 0, "served from the cache"


async def test_another_pods_lock_is_left_alone(tmp_path: Path) -> None:
    api = FakeApi([pod("p", "GPU-A,NVIDIA,1000,10:;;")], lock_owner="someone-else")
    allocator, _ = make(api, tmp_path)
    await allocator.allocate([1])
    assert annotations(api, "p")[keys.BIND_PHASE] == "success"
    assert keys.NODE_LOCK in api.node["metadata"]["annotations"]


async def test_lock_release_retries_a_lost_race(tmp_path: Path) -> None:
    api = FakeApi([pod("p", "GPU-A,NVIDIA,1000,10:;;")], lock_owner="p")
    api.conflicts = 2
    allocator, _ = make(api, tmp_path)
    await allocator.allocate([1])
    assert keys.NODE_LOCK not in api.node["metadata"]["annotations"]


async def test_a_pod_the_cache_has_not_seen_is_found_by_a_fresh_list(tmp_path: Path) -> None:
    api = FakeApi([pod("late", "GPU-A,NVIDIA,1000,10:;;")])
    allocator, _ = make(api, tmp_path, cached=False)
    (allocation,) = await allocator.allocate([1])
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-A"
    assert api.lists == 1


async def test_no_waiting_pod_is_a_clear_error(tmp_path: Path) -> None:
    api = FakeApi([pod("p", "GPU-A,NVIDIA,1000,10:GPU-B,NVIDIA,1000,10:;;")])
    allocator, telemetry = make(api, tmp_path)
    with pytest.raises(AllocateError, match="no pod on node n1 is waiting for a container of 1 device"):
        await allocator.allocate([1])
    samples = telemetry.metrics.registry.get_sample_value(
        "hamipy_device_plugin_allocations_total", {"result": "failed", "reason": "NoPendingPod"}
    )
    assert samples == 1
    assert annotations(api, "p")[keys.BIND_PHASE] == "allocating", "a pod that did not match is untouched"


async def test_malformed_pod_is_marked_failed_and_its_lock_released(tmp_path: Path) -> None:
    api = FakeApi([pod("bad", "GPU-A,NVIDIA,lots,10:;;")], lock_owner="bad")
    allocator, _ = make(api, tmp_path)
    with pytest.raises(AllocateError):
        await allocator.allocate([1])
    assert annotations(api, "bad")[keys.BIND_PHASE] == "failed"
    assert keys.NODE_LOCK not in api.node["metadata"]["annotations"]


async def test_an_unbuildable_allocation_fails_the_pod(tmp_path: Path) -> None:
    # 0 MiB would read as "no limit" in the interposer: refused, and the pod is told.
    api = FakeApi([pod("zero", "GPU-A,NVIDIA,0,10:;;")])
    allocator, _ = make(api, tmp_path)
    with pytest.raises(AllocateError, match="zero"):
        await allocator.allocate([1])
    assert annotations(api, "zero")[keys.BIND_PHASE] == "failed"
