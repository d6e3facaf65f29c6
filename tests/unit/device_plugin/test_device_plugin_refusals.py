"""The device plugin serves only what the scheduler decided, to the pod it decided it for: a waiting
pod that asks for no GPU, that another scheduler placed, or whose allocation is not what it asks
for is never served; the kubelet's device IDs must be ours and lie on the planned GPUs."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import builders
import grpc
import pytest
from allocator_support import (
    DEVMEM,
    RULES,
    UUID_A,
    UUID_B,
    UUID_C,
    annotations_of,
    dev,
    hijack_pod,
    legit_pod,
    logged,
    make_allocator,
    phase_of,
    refused_over_grpc,
    waiting_pod,
)
from plugin_fakes import NODE, kubelet_view, node_kube

from hamipy.device_plugin.allocating import Choice, ServeRules, choose, problems
from hamipy.device_plugin.errors import AllocateError, UnknownDevice
from hamipy.protocol import keys
from hamipy.protocol.resources import ResourceNames

NOT_SERVED = "waiting pod not served: it breaks a serving rule"


def in_line(
    pods: list[dict[str, Any]], count: int = 1, rules: ServeRules = RULES, *, also: Sequence[str] = ()
) -> Choice:
    """The choice for ``count`` devices, the kubelet admitting ``pods`` in bind order (and listing
    ``also`` as being admitted too)."""
    return choose(pods, node=NODE, device_count=count, kubelet=kubelet_view(pods, also=also), rules=rules)


def served_name(pods: list[dict[str, Any]], count: int = 1, rules: ServeRules = RULES) -> str | None:
    served = in_line(pods, count, rules).served
    return None if served is None else served.name


# --- who is served (allocating.choose) --------------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["default-scheduler", "hami-scheduler"])
def test_a_pod_asking_no_gpu_is_skipped_and_the_next_pod_gets_its_own_slot(scheduler: str) -> None:
    hijack = hijack_pod()
    hijack["spec"]["schedulerName"] = scheduler  # asking for no GPU is enough to be skipped
    # The kubelet lists the hijack pod (admitted: it asks for no device) and admits the next.
    choice = in_line([hijack, legit_pod()])
    assert choice.served is not None
    assert (choice.served.name, choice.served.devices) == ("legit", [dev(UUID_B, mem=30000, cores=40)])
    assert choice.refused is None
    ((skipped, why),) = choice.skipped
    assert skipped["metadata"]["name"] == "hijack"
    assert "containers[0] 'main' asks for no nvidia.com/gpu but is planned 1 device(s)" in why


def test_a_pod_of_another_scheduler_in_line_is_refused_not_given_the_next_pods_slot() -> None:
    steal = waiting_pod(
        "steal",
        builders.container("main", gpu=1),
        slots=[[dev(UUID_B, mem=30000, cores=40)]],
        scheduler="default-scheduler",
        bind_time=1,
    )
    choice = in_line([steal, legit_pod(bind_time=2)])  # the kubelet is admitting "steal"
    assert choice.served is None
    assert choice.refused is not None
    assert choice.refused[0]["metadata"]["name"] == "steal"
    assert choice.refused[1] == "schedulerName is 'default-scheduler', not 'hami-scheduler'"


def test_a_pod_naming_no_scheduler_is_the_default_schedulers() -> None:
    pod = waiting_pod("unnamed", builders.container("main", gpu=1), slots=[[dev(UUID_A)]], scheduler=None)
    assert problems(pod, RULES) == ["schedulerName is 'default-scheduler', not 'hami-scheduler'"]


def test_a_rule_breaker_not_in_line_for_the_request_is_skipped() -> None:
    # Both listed; "other" asks for 2 GPUs: the kubelet cannot be allocating it with 1 device.
    other = waiting_pod(
        "other",
        builders.container("main", gpu=2),
        slots=[[dev(UUID_A), dev(UUID_C)]],
        scheduler="default-scheduler",
        bind_time=1,
    )
    choice = in_line([other, legit_pod(bind_time=2)], also=["legit"])
    assert choice.served is not None
    assert choice.served.name == "legit"
    assert [p["metadata"]["name"] for p, _ in choice.skipped] == ["other"]


@pytest.mark.parametrize(
    ("container", "slot", "why"),
    [
        (
            builders.container("main", gpu=2),
            [dev(UUID_A)],
            "containers[0] 'main' asks for 2 nvidia.com/gpu but is planned 1",
        ),
        (
            builders.container("main", gpu=2),
            [dev(UUID_A), dev(UUID_A)],
            f"containers[0] 'main' is planned one GPU twice ({UUID_A}, {UUID_A})",
        ),
        (
            builders.container("main", gpu=1, gpumem=30000),
            [dev(UUID_A, mem=1)],
            f"containers[0] 'main' asks for 30000 MiB on {UUID_A} but is planned 1",
        ),
        (
            builders.container("main", gpu=1, gpucores=40),
            [dev(UUID_A, cores=0)],
            f"containers[0] 'main' asks for 40 % cores on {UUID_A} but is planned 0",
        ),
        (
            builders.container("main", gpu=1, gpucores=150),  # clamped to 100, as the scheduler does
            [dev(UUID_A, cores=150)],
            f"containers[0] 'main' asks for 100 % cores on {UUID_A} but is planned 150",
        ),
        (
            builders.container("main", gpu=1, gpumem_percentage=50),
            [dev(UUID_A, mem=1)],
            f"containers[0] 'main' asks for {DEVMEM // 2} MiB on {UUID_A} but is planned 1",
        ),
    ],
    ids=["count", "one-gpu-twice", "memory", "cores", "cores-clamped", "memory-percentage"],
)
def test_an_allocation_that_is_not_what_the_container_asks_is_refused(
    container: dict[str, Any], slot: list[Any], why: str
) -> None:
    pod = waiting_pod("forged", container, slots=[slot])
    assert why in problems(pod, RULES)
    asked = int(container["resources"]["limits"][keys.RESOURCE_COUNT])
    choice = in_line([pod, legit_pod()], asked)  # the kubelet is admitting "forged"
    assert choice.refused is not None
    assert choice.refused[0]["metadata"]["name"] == "forged"
    assert choice.served is None


@pytest.mark.parametrize(
    "container",
    [
        builders.container("main", gpu=1),  # memory and cores from the scheduler's defaults
        builders.container("main", gpu=1, gpumem=1234, gpucores=0),
        builders.container("main", gpu=1, gpumem_percentage=25),
        builders.container("main", gpu=1, gpumem=1234, gpumem_percentage=25),  # gpumem wins
    ],
    ids=["defaults", "explicit", "percentage", "memory-over-percentage"],
)
def test_an_allocation_matching_the_containers_asks_is_served(container: dict[str, Any]) -> None:
    limits = container["resources"]["limits"]
    mem = int(
        limits.get(
            keys.RESOURCE_MEMORY, DEVMEM * int(limits.get(keys.RESOURCE_MEMORY_PERCENTAGE, 100)) // 100
        )
    )
    pod = waiting_pod("fine", container, slots=[[dev(UUID_A, mem=mem, cores=0)]])
    assert problems(pod, RULES) == []
    assert served_name([pod]) == "fine"


def test_a_percentage_on_a_gpu_the_node_does_not_register_is_not_checked() -> None:
    pod = waiting_pod(
        "elsewhere",
        builders.container("main", gpu=1, gpumem_percentage=50),
        slots=[[dev("GPU-not-here", mem=7)]],
    )
    assert problems(pod, RULES) == []


def test_a_later_slot_that_breaks_a_rule_refuses_the_pod_at_its_first_container() -> None:
    pod = waiting_pod(
        "two",
        builders.container("first", gpu=1),
        builders.container("second"),  # asks nothing, yet planned a GPU
        slots=[[dev(UUID_A)], [dev(UUID_B)]],
    )
    choice = in_line([pod])
    assert choice.refused is not None
    assert "containers[1] 'second' asks for no nvidia.com/gpu" in choice.refused[1]


def test_an_init_container_and_app_containers_are_checked_in_slot_order() -> None:
    pod = waiting_pod(
        "multi",
        builders.container("sidecar"),
        builders.container("app", gpu=2, gpumem=2000),
        init=[builders.container("setup", gpu=1, gpumem=500)],
        slots=[[dev(UUID_A, mem=500)], [], [dev(UUID_B, mem=2000), dev(UUID_C, mem=2000)]],
    )
    assert problems(pod, RULES) == []
    served = in_line([pod]).served
    assert served is not None
    assert (served.container, served.slot) == ("setup", 0)


def test_the_configured_scheduler_and_resource_names_are_the_rules() -> None:
    rules = ServeRules(scheduler_name="gpu-scheduler", names=ResourceNames(count="nvidia.com/vgpu"))
    pod = waiting_pod(
        "vgpu",
        builders.container("main", limits={"nvidia.com/vgpu": "1"}),
        slots=[[dev(UUID_A)]],
        scheduler="gpu-scheduler",
    )
    assert served_name([pod], rules=rules) == "vgpu"
    assert problems(pod, RULES) == [
        "schedulerName is 'gpu-scheduler', not 'hami-scheduler'",
        "containers[0] 'main' asks for no nvidia.com/gpu but is planned 1 device(s)",
    ]


def test_the_shape_hamis_scheduler_writes_is_served() -> None:
    # HAMi >= 2.9: init containers first, empty slots kept, type NVIDIA; its schedulerName is ours.
    pod = builders.pod(
        "from-hami",
        builders.container("main", gpu=1, gpumem=3000, gpucores=30),
        init=[builders.container("setup")],
        namespace="ns",
        uid="uid-ns-from-hami",
        annotations={
            keys.VGPU_NODE: NODE,
            keys.VGPU_TIME: "1750000000",
            keys.DEVICES_ALLOCATED: f";{UUID_A},NVIDIA,3000,30:;",
            keys.DEVICES_TO_ALLOCATE: f";{UUID_A},NVIDIA,3000,30:;",
            keys.BIND_PHASE: "allocating",
            keys.BIND_TIME: "1750000000",
        },
        node_name=NODE,
        scheduler_name="hami-scheduler",
    )
    served = in_line([pod]).served
    assert served is not None
    assert (served.container, served.devices) == ("main", [dev(UUID_A, mem=3000, cores=30)])


# --- Allocate (allocator.Allocator) -----------------------------------------------------------------


async def test_the_hijack_pod_is_never_served_and_the_legitimate_pod_gets_its_own_slot(
    tmp_path: Path,
) -> None:
    api = node_kube(hijack_pod(), legit_pod())
    log = io.StringIO()
    allocator = await make_allocator(api, tmp_path, log=log)
    (allocation,) = await allocator.allocate([[f"{UUID_B}-0"]])
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == UUID_B
    assert allocation.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "30000m"
    assert allocation.envs["CUDA_DEVICE_SM_LIMIT"] == "40"
    assert phase_of(api, "legit") == "success"
    assert phase_of(api, "hijack") == "allocating", "a pod that is not in line is left alone"
    (line,) = logged(log, NOT_SERVED)
    assert (line["namespace"], line["pod"], line["uid"]) == ("ns", "hijack", "uid-ns-hijack")
    assert "asks for no nvidia.com/gpu" in line["reason"]
    # Nobody else waits: a further Allocate is refused, and the hijack pod is not logged again.
    with pytest.raises(AllocateError, match="no pod the kubelet is admitting on node n1"):
        await allocator.allocate([[f"{UUID_A}-0"]])
    assert len(logged(log, NOT_SERVED)) == 1
    assert phase_of(api, "hijack") == "allocating"


async def test_a_pod_of_another_scheduler_fails_and_the_real_pod_is_then_served(tmp_path: Path) -> None:
    steal = waiting_pod(
        "steal",
        builders.container("main", gpu=1, gpumem=30000, gpucores=40),
        slots=[[dev(UUID_B, mem=30000, cores=40)]],
        scheduler="default-scheduler",
        bind_time=1,
    )
    api = node_kube(steal, legit_pod(bind_time=2))
    allocator = await make_allocator(api, tmp_path)
    with pytest.raises(
        AllocateError, match="pod ns/steal is not served: schedulerName is 'default-scheduler'"
    ):
        await allocator.allocate([[f"{UUID_B}-0"]])
    assert phase_of(api, "steal") == "failed"
    assert phase_of(api, "legit") == "allocating"
    (allocation,) = await allocator.allocate([[f"{UUID_B}-1"]])
    assert allocation.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "30000m"
    assert phase_of(api, "legit") == "success"
    samples = allocator.telemetry.metrics.registry.get_sample_value(
        "hamipy_device_plugin_allocations_total", {"result": "failed", "reason": "NotServable"}
    )
    assert samples == 1


async def test_device_ids_on_another_gpu_are_refused_and_the_pod_failed(tmp_path: Path) -> None:
    api = node_kube(legit_pod())
    allocator = await make_allocator(api, tmp_path)
    with pytest.raises(
        AllocateError, match=rf"pod ns/legit: device IDs \['{UUID_A}-0'\] are not on the GPUs"
    ):
        await allocator.allocate([[f"{UUID_A}-0"]])
    assert phase_of(api, "legit") == "failed"
    assert annotations_of(api, "legit")[keys.DEVICES_TO_ALLOCATE] == f"{UUID_B},NVIDIA,30000,40:;"
    samples = allocator.telemetry.metrics.registry.get_sample_value(
        "hamipy_device_plugin_allocations_total", {"result": "failed", "reason": "WrongDevices"}
    )
    assert samples == 1


@pytest.mark.parametrize(
    ("ids", "ok"),
    [
        ([f"{UUID_C}-4", f"{UUID_A}-9"], True),  # any order, any replica
        ([f"{UUID_A}-0", f"{UUID_A}-1"], False),  # two IDs of one GPU
        ([f"{UUID_A}-0", f"{UUID_B}-0"], False),  # one GPU not planned
    ],
    ids=["planned-gpus", "one-gpu-twice", "wrong-gpu"],
)
async def test_a_two_gpu_container_needs_ids_on_both_planned_gpus(
    tmp_path: Path, ids: list[str], ok: bool
) -> None:
    pod = waiting_pod("pair", builders.container("main", gpu=2), slots=[[dev(UUID_A), dev(UUID_C)]])
    api = node_kube(pod)
    allocator = await make_allocator(api, tmp_path)
    if ok:
        (allocation,) = await allocator.allocate([ids])
        assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == f"{UUID_A},{UUID_C}"
    else:
        with pytest.raises(AllocateError, match="are not on the GPUs planned"):
            await allocator.allocate([ids])
    assert phase_of(api, "pair") == ("success" if ok else "failed")


@pytest.mark.parametrize(
    "device",
    ["GPU-dddddddd-0000-4000-8000-000000000000-0", f"{UUID_A}-10", UUID_A, "", "nvidia0"],
    ids=["unknown-gpu", "replica-past-the-split", "no-replica", "empty", "other-plugins-id"],
)
async def test_an_id_that_is_not_ours_is_refused_without_touching_any_pod(
    tmp_path: Path, device: str
) -> None:
    api = node_kube(hijack_pod(), legit_pod())
    allocator = await make_allocator(api, tmp_path)
    with pytest.raises(
        UnknownDevice, match=f"device IDs \\[{device}\\] are not devices of the nvidia.com/gpu"
    ):
        await allocator.allocate([[device]])
    assert [m for m, _ in api.calls if m != "GET"] == []
    assert (phase_of(api, "hijack"), phase_of(api, "legit")) == ("allocating", "allocating")


# --- over gRPC, as the kubelet sees it --------------------------------------------------------------


async def test_the_kubelet_is_told_invalid_argument_for_ids_that_are_not_ours(tmp_path: Path) -> None:
    refused = await refused_over_grpc(await make_allocator(node_kube(legit_pod()), tmp_path), "GPU-nope-0")
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-nope-0" in (refused.details() or "")


async def test_a_refusal_naming_thousands_of_unknown_ids_fits_grpcs_metadata(tmp_path: Path) -> None:
    # The reason travels as grpc-message metadata (8 KiB by default): past it the kubelet would get
    # a transport error instead of the reason.
    ids = [f"GPU-{i:08d}-0000-4000-8000-000000000000-{i}" for i in range(2000)]
    refused = await refused_over_grpc(await make_allocator(node_kube(legit_pod()), tmp_path), *ids)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.details() or ""
    assert ids[0] in details
    assert ids[19] in details
    assert ids[20] not in details
    assert "and 1980 more" in details
    assert len(details.encode()) < 4096


async def test_the_kubelet_is_told_failed_precondition_for_ids_on_the_wrong_gpu(tmp_path: Path) -> None:
    allocator = await make_allocator(node_kube(legit_pod()), tmp_path)
    refused = await refused_over_grpc(allocator, f"{UUID_C}-0")
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{UUID_C}-0" in (refused.details() or "")
