"""GetPreferredAllocation: the kubelet is steered to device IDs on the GPUs the scheduler planned
for the container it is admitting (the same pod Allocate would serve), or left to choose itself."""

from __future__ import annotations

import io
from pathlib import Path

import builders
from allocator_support import (
    DEVICE_IDS,
    UUID_A,
    UUID_B,
    UUID_C,
    UUIDS,
    dev,
    hijack_pod,
    legit_pod,
    logged,
    make_allocator,
    phase_of,
    plugin_stub,
    waiting_pod,
)
from plugin_fakes import PODS, node_kube

from hamipy.device_plugin.allocator import Preference
from hamipy.device_plugin.devices import preferred_ids
from hamipy.device_plugin.servicer import OPTIONS
from hamipy.extender.filtering import build_ask
from hamipy.extender.fitting import fit_pod
from hamipy.extender.model import Gpu, NodeName, NodeState
from hamipy.kube.errors import KubeError
from hamipy.kubelet_api.v1beta1 import api_pb2
from hamipy.protocol import keys
from hamipy.protocol.config import Config

A = [f"{UUID_A}-{i}" for i in range(3)]
B = [f"{UUID_B}-{i}" for i in range(3)]
C = [f"{UUID_C}-{i}" for i in range(3)]


def everything() -> Preference:
    """One container's request for one device, every device available."""
    return Preference(list(DEVICE_IDS), [], 1)


# --- devices.preferred_ids --------------------------------------------------------------------------


def test_one_id_on_each_planned_gpu_in_plan_order() -> None:
    assert preferred_ids([UUID_C, UUID_A], [*A, *B, *C], []) == [C[0], A[0]]


def test_must_include_is_kept_for_its_gpu() -> None:
    assert preferred_ids([UUID_A, UUID_B], [*A, *B], [B[2]]) == [A[0], B[2]]


def test_no_preference_when_the_plan_cannot_be_met() -> None:
    assert preferred_ids([UUID_A, UUID_B], A, []) == [], "no ID left on a planned GPU"
    assert preferred_ids([UUID_A], [*A, *C], [C[0]]) == [], "must_include on a GPU not planned"
    assert preferred_ids([UUID_A, UUID_B], [*A, *B], [A[0], A[1]]) == [], "two must_include on one GPU"


# --- Allocator.preferred ----------------------------------------------------------------------------


async def test_the_pod_in_line_gets_ids_on_its_planned_gpu_past_a_hijack_pod(tmp_path: Path) -> None:
    api = node_kube(hijack_pod(), legit_pod())
    log = io.StringIO()
    allocator = await make_allocator(api, tmp_path, log=log)
    assert await allocator.preferred([everything()]) == [[f"{UUID_B}-0"]]
    assert [m for m, _ in api.calls if m != "GET"] == [], "nothing is written"
    assert phase_of(api, "legit") == "allocating"
    (line,) = logged(log, "preferred allocation")
    assert (line["pod"], line["container"], line["devices"]) == ("legit", "main", [f"{UUID_B}-0"])


async def test_a_two_gpu_container_gets_one_id_on_each_planned_gpu(tmp_path: Path) -> None:
    pod = waiting_pod("pair", builders.container("main", gpu=2), slots=[[dev(UUID_C), dev(UUID_A)]])
    allocator = await make_allocator(node_kube(pod), tmp_path)
    available = [*A, *B, *C]
    assert await allocator.preferred([Preference(available, [], 2)]) == [[C[0], A[0]]]


async def test_must_include_from_an_init_container_is_honoured(tmp_path: Path) -> None:
    pod = waiting_pod(
        "reuse",
        builders.container("app", gpu=2),
        init=[builders.container("setup", gpu=1)],
        slots=[[dev(UUID_B)], [dev(UUID_B), dev(UUID_C)]],
    )
    api = node_kube(pod)
    allocator = await make_allocator(api, tmp_path)
    await allocator.allocate([[B[1]]])  # the init container
    # The kubelet offers what the init container gave back and asks for it to be kept.
    answer = await allocator.preferred([Preference([*A, *B, *C], [B[1]], 2)])
    assert answer == [[B[1], C[0]]]
    # Inconsistent with the plan: no preference, the kubelet chooses.
    assert await allocator.preferred([Preference([*A, *B, *C], [A[0]], 2)]) == [[]]


async def test_two_containers_get_their_own_gpus_one_after_the_other(tmp_path: Path) -> None:
    pod = waiting_pod(
        "two",
        builders.container("first", gpu=1),
        builders.container("second", gpu=1),
        slots=[[dev(UUID_A)], [dev(UUID_C)]],
    )
    api = node_kube(pod)
    allocator = await make_allocator(api, tmp_path)
    # As the kubelet calls them: a preference, then Allocate, per container.
    assert await allocator.preferred([everything()]) == [[f"{UUID_A}-0"]]
    await allocator.allocate([[f"{UUID_A}-0"]])
    assert await allocator.preferred([everything()]) == [[f"{UUID_C}-0"]]
    await allocator.allocate([[f"{UUID_C}-0"]])
    assert phase_of(api, "two") == "success"
    # Both in one request: the second is answered as if the first were served.
    pod2 = waiting_pod(
        "both",
        builders.container("first", gpu=1),
        builders.container("second", gpu=1),
        slots=[[dev(UUID_B)], [dev(UUID_A)]],
    )
    allocator2 = await make_allocator(node_kube(pod2), tmp_path)
    assert await allocator2.preferred([everything(), everything()]) == [[f"{UUID_B}-0"], [f"{UUID_A}-0"]]


async def test_no_pod_in_line_is_an_empty_preference_after_one_fresh_list(tmp_path: Path) -> None:
    api = node_kube(hijack_pod())
    allocator = await make_allocator(api, tmp_path)
    assert await allocator.preferred([everything()]) == [[]]
    assert api.calls.count(("GET", PODS)) == 1


async def test_a_pod_the_cache_has_not_seen_is_found_by_a_fresh_list(tmp_path: Path) -> None:
    api = node_kube()
    allocator = await make_allocator(api, tmp_path)
    api.add(legit_pod())
    assert await allocator.preferred([everything()]) == [[f"{UUID_B}-0"]]
    assert api.calls.count(("GET", PODS)) == 1


async def test_a_rule_breaker_in_line_gets_no_preference(tmp_path: Path) -> None:
    steal = waiting_pod(
        "steal", builders.container("main", gpu=1), slots=[[dev(UUID_A)]], scheduler="default-scheduler"
    )
    api = node_kube(steal, legit_pod())
    allocator = await make_allocator(api, tmp_path)
    assert await allocator.preferred([everything()]) == [[]]
    assert phase_of(api, "steal") == "allocating", "failing it is Allocate's business"


async def test_an_api_error_is_an_empty_preference_not_an_error(tmp_path: Path) -> None:
    api = node_kube()
    allocator = await make_allocator(api, tmp_path)

    async def failing_list() -> tuple[list[dict[str, object]], str]:
        raise KubeError("GET pods: HTTP 500", status=500)

    allocator.api.node_pods = failing_list  # type: ignore[method-assign]
    assert await allocator.preferred([everything()]) == [[]]


# --- over gRPC --------------------------------------------------------------------------------------


async def test_the_plugin_offers_preferences_and_answers_them_over_grpc(tmp_path: Path) -> None:
    assert OPTIONS.get_preferred_allocation_available
    allocator = await make_allocator(node_kube(hijack_pod(), legit_pod()), tmp_path)
    async with plugin_stub(allocator) as stub:
        options = await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        assert options.get_preferred_allocation_available
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(DEVICE_IDS), allocation_size=1
                ),
                api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=A, allocation_size=3),
            ]
        )
        response = await stub.GetPreferredAllocation(request, timeout=10)
    assert [list(r.deviceIDs) for r in response.container_responses] == [[f"{UUID_B}-0"], []]


async def test_a_topology_aware_pair_is_what_the_kubelet_is_steered_to(tmp_path: Path) -> None:
    # The extender picks the bridged pair (B, C) for a 2-GPU topology-aware pod, though spread alone
    # would take A first; the kubelet is then steered to IDs on exactly B and C.
    bridged = {(UUID_B, UUID_C), (UUID_C, UUID_B)}
    scores = {a: {b: 1250 if (a, b) in bridged else 10 for b in UUIDS if b != a} for a in UUIDS}
    node = NodeState(NodeName("n"), registered=True, pair_scores=scores)
    node.gpus = [Gpu.of(builders.gpu(u, i)) for i, u in enumerate(UUIDS)]
    asked = builders.container("main", gpu=2, gpumem=1000, gpucores=10)
    annotations = {keys.GPU_SCHEDULER_POLICY: "topology-aware"}
    fit = fit_pod(node, build_ask(builders.gpu_pod("pair", asked, annotations=annotations), Config()))
    assert fit.devices is not None
    assert {d.uuid for d in fit.devices[0]} == {UUID_B, UUID_C}
    pod = waiting_pod("pair", asked, slots=fit.devices)
    allocator = await make_allocator(node_kube(pod), tmp_path)
    (ids,) = await allocator.preferred([Preference([*A, *B, *C], [], 2)])
    assert sorted(ids) == sorted([B[0], C[0]])
