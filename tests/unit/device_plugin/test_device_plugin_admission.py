"""Allocate serves the pod the kubelet is admitting, as its PodResources API lists it: never the
first pod bound, never a pod the kubelet rejected or has not reached, never a waiting pod's slot
for a pod without an allocation; and nobody when the kubelet's view cannot tell (two pods in line)
or cannot be read: the kubelet's admission fails with the reason and no pod is marked."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import builders
import grpc
import pytest
from allocator_support import (
    DEVICE_IDS,
    UUID_A,
    UUID_B,
    UUID_C,
    annotations_of,
    dev,
    legit_pod,
    logged,
    make_allocator,
    phase_of,
    plugin_stub,
    refused_over_grpc,
    waiting_pod,
)
from fake_kube import FakeKube
from plugin_fakes import NODE, PODS, FakePodResources, node_kube

from hamipy.device_plugin.allocating import KubeletPod, KubeletPods
from hamipy.device_plugin.allocator import Allocator, Answer, Preference
from hamipy.device_plugin.errors import AllocateError, KubeletUnreachable
from hamipy.kubelet_api.v1beta1 import api_pb2
from hamipy.protocol import keys


def one_gpu_pod(name: str, uuid: str, mem: int, *, bind_time: int) -> dict[str, Any]:
    """A pod our scheduler placed: ``mem`` MiB of GPU ``uuid`` for its container "main"."""
    return waiting_pod(
        name,
        builders.container("main", gpu=1, gpumem=mem, gpucores=mem // 1000),
        slots=[[dev(uuid, mem=mem, cores=mem // 1000)]],
        bind_time=bind_time,
    )


async def admit(allocator: Allocator) -> Answer:
    """What the kubelet does for a one-GPU container: asks which IDs to take, then Allocates them."""
    (ids,) = await allocator.preferred([Preference(list(DEVICE_IDS), [], 1)])
    assert ids, "a preference for the pod in line"
    (allocation,) = await allocator.allocate([ids])
    return allocation


def writes(api: FakeKube) -> list[tuple[str, str]]:
    return [(method, path) for method, path in api.calls if method != "GET"]


def failures(allocator: Allocator, reason: str) -> float | None:
    return allocator.telemetry.metrics.registry.get_sample_value(
        "hamipy_device_plugin_allocations_total", {"result": "failed", "reason": reason}
    )


PLANNED = {"p1": (UUID_A, 10000), "p2": (UUID_B, 20000), "p3": (UUID_C, 30000)}


@pytest.mark.parametrize(
    "order", [["p3", "p1", "p2"], ["p2", "p3", "p1"]], ids=["creation-order", "retried-first"]
)
async def test_each_allocate_serves_the_pod_the_kubelet_admits_not_the_first_bound(
    tmp_path: Path, order: list[str]
) -> None:
    # Bound p1, p2, p3; a restarted kubelet (or one retrying after a plugin crash) admits them in
    # another order: each container gets its own pod's slot.
    pods = [one_gpu_pod(name, *PLANNED[name], bind_time=i) for i, name in enumerate(PLANNED)]
    api = node_kube(*pods)
    kubelet = FakePodResources(api)
    kubelet.order = order
    allocator = await make_allocator(api, tmp_path, kubelet=kubelet)
    for i, name in enumerate(order):
        uuid, mem = PLANNED[name]
        allocation = await admit(allocator)
        assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == uuid
        assert allocation.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{mem}m"
        assert allocation.limits_path == f"{tmp_path}/vgpu/containers/uid-ns-{name}_main/limits"
        assert phase_of(api, name) == "success"
        for later in order[i + 1 :]:
            assert phase_of(api, later) == "allocating"
            left = annotations_of(api, later)
            assert left[keys.DEVICES_TO_ALLOCATE] == left[keys.DEVICES_ALLOCATED], "its whole slot is kept"


async def test_a_pod_the_kubelet_rejected_is_never_served_and_the_next_gets_its_own_slot(
    tmp_path: Path,
) -> None:
    # The plugin crashed mid-Allocate: the kubelet rejected "crashed" (it is no longer listed) but
    # its status has not landed, so it still says bind-phase=allocating; it was bound first.
    crashed = one_gpu_pod("crashed", UUID_A, 10000, bind_time=1)
    api = node_kube(crashed, one_gpu_pod("next", UUID_B, 20000, bind_time=2))
    kubelet = FakePodResources(api)
    kubelet.order = ["next"]
    allocator = await make_allocator(api, tmp_path, kubelet=kubelet)
    allocation = await admit(allocator)
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == UUID_B
    assert allocation.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20000m"
    assert phase_of(api, "next") == "success"
    assert annotations_of(api, "crashed") == crashed["metadata"]["annotations"]
    # Nothing else is admitted: a further Allocate is refused; "crashed" is still not served.
    with pytest.raises(AllocateError, match="no pod the kubelet is admitting on node n1"):
        await allocator.allocate([[f"{UUID_A}-0"]])
    assert annotations_of(api, "crashed") == crashed["metadata"]["annotations"]
    assert not (tmp_path / "vgpu" / "containers" / "uid-ns-crashed_main").exists()


def intruder(kind: str) -> dict[str, Any]:
    """A GPU pod bound to NODE by ``spec.nodeName``, not placed by our scheduler: another scheduler's,
    or ours by name but with no allocation."""
    return builders.gpu_pod(
        "intruder",
        builders.container("main", gpu=1),
        node_name=NODE,
        phase=None,
        scheduler_name="my-scheduler" if kind == "other-scheduler" else builders.SCHEDULER,
    )


@pytest.mark.parametrize("kind", ["other-scheduler", "no-allocation"])
async def test_a_gpu_pod_without_an_allocation_is_refused_and_takes_no_waiting_pods_slot(
    tmp_path: Path, kind: str
) -> None:
    legit = legit_pod(bind_time=1)
    api = node_kube(legit, intruder(kind))
    log = io.StringIO()
    allocator = await make_allocator(api, tmp_path, log=log)

    async def admitting_the_intruder() -> KubeletPods:
        return {("ns", "intruder"): KubeletPod("ns", "intruder", {"main": frozenset()})}

    allocator.kubelet = admitting_the_intruder
    assert await allocator.preferred([Preference(list(DEVICE_IDS), [], 1)]) == [[]]
    with pytest.raises(AllocateError, match="no pod the kubelet is admitting on node n1 waits for"):
        await allocator.allocate([[f"{UUID_B}-0"]])
    assert annotations_of(api, "legit") == legit["metadata"]["annotations"]
    assert writes(api) == []
    assert not (tmp_path / "vgpu" / "containers").exists()
    assert failures(allocator, "NoPendingPod") == 1
    # The kubelet then admits the waiting pod: it gets its own slot.
    allocator.kubelet = FakePodResources(api).pods
    allocation = await admit(allocator)
    assert allocation.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "30000m"
    assert phase_of(api, "legit") == "success"


async def test_two_pods_that_could_be_in_line_are_refused_naming_both_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    pods = [one_gpu_pod("a", UUID_A, 10000, bind_time=1), one_gpu_pod("b", UUID_B, 20000, bind_time=1)]
    before = copy.deepcopy(pods)
    api = node_kube(*pods)
    kubelet = FakePodResources(api)
    kubelet.also = {"b"}  # the kubelet lists both as being admitted (its restart race)
    log = io.StringIO()
    allocator = await make_allocator(api, tmp_path, log=log, kubelet=kubelet)
    assert await allocator.preferred([Preference(list(DEVICE_IDS), [], 1)]) == [[]]
    with pytest.raises(AllocateError, match=r"any of \['ns/a', 'ns/b'\] for 1 device\(s\) on node n1"):
        await allocator.allocate([[f"{UUID_A}-0"]])
    for pod in before:
        name = pod["metadata"]["name"]
        assert annotations_of(api, name) == pod["metadata"]["annotations"], f"{name} untouched"
    assert writes(api) == []
    assert not (tmp_path / "vgpu" / "containers").exists()
    assert failures(allocator, "Ambiguous") == 1
    (line,) = logged(log, "allocate matches more than one waiting pod")
    assert line["pods"] == ["ns/a", "ns/b"]
    # Over gRPC the kubelet is told why, and gets no preference.
    refused = await refused_over_grpc(allocator, f"{UUID_A}-0")
    async with plugin_stub(allocator) as stub:
        preferred = await stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=list(DEVICE_IDS), allocation_size=1
                    )
                ]
            ),
            timeout=10,
        )
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "['ns/a', 'ns/b']" in (refused.details() or "")
    assert [list(r.deviceIDs) for r in preferred.container_responses] == [[]]
    assert writes(api) == []


async def test_a_kubelet_that_does_not_answer_refuses_the_allocate_and_touches_no_pod(
    tmp_path: Path,
) -> None:
    legit = legit_pod()
    api = node_kube(legit)
    kubelet = FakePodResources(api)
    kubelet.unreachable = True
    log = io.StringIO()
    allocator = await make_allocator(api, tmp_path, log=log, kubelet=kubelet)
    with pytest.raises(KubeletUnreachable, match="PodResources API did not answer: UNAVAILABLE"):
        await allocator.allocate([[f"{UUID_B}-0"]])
    assert await allocator.preferred([Preference(list(DEVICE_IDS), [], 1)]) == [[]]
    (line,) = logged(log, "no preferred allocation: pods not known")
    assert "PodResources API did not answer" in line["error"]
    assert failures(allocator, "KubeletUnreachable") == 1
    refused = await refused_over_grpc(allocator, f"{UUID_B}-0")
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "PodResources API did not answer: UNAVAILABLE" in (refused.details() or "")
    assert annotations_of(api, "legit") == legit["metadata"]["annotations"]
    assert writes(api) == []
    assert api.calls.count(("GET", PODS)) == 0, "no pod is looked at"
    assert not (tmp_path / "vgpu" / "containers").exists()
    # Once it answers, the pod it admits is served.
    kubelet.unreachable = False
    allocation = await admit(allocator)
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == UUID_B
