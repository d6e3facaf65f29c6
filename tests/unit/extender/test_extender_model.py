"""The cluster model: what a node offers, what each pod takes, and how list and watch events change
it (``hamipy.extender.model``, pure). The filter trusts these numbers without looking again, so a
wrong one places a pod on a full GPU or leaves a free one unused."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import builders
import pytest
from builders import allocation, container, gpu, gpu_node, gpu_pod
from hypothesis import given, settings
from hypothesis import strategies as st

from hamipy.extender.filtering import build_ask, decide
from hamipy.extender.model import (
    ClusterModel,
    Gpu,
    NodeName,
    NodeState,
    PodUid,
    node_from_json,
    pod_finished,
    pod_leaving,
    pod_usage,
)
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.identifiers import GpuUuid
from hamipy.protocol.node_handshake import requesting

CONFIG = Config()
NOW = 1_000_000.0
"""Epoch seconds, whole: handshake stamps have second precision."""
Dims = tuple[int, int, int]
TWO_GPUS = [gpu("A", 0, count=10, mem=1000, core=100), gpu("B", 1, count=10, mem=1000, core=100)]


def dev(uuid: str, mem: int, cores: int = 0) -> ContainerDevice:
    return ContainerDevice(uuid, keys.DEVICE_VENDOR_NVIDIA, mem, cores)


def running(
    name: str,
    node_name: str | None,
    devices: Sequence[Sequence[ContainerDevice]] | str,
    *,
    vgpu_node: str | None = None,
    phase: str = "Running",
    init: int = 0,
) -> dict[str, Any]:
    """A pod holding ``devices`` (its allocation annotation), on ``node_name`` or, mid-bind,
    ``vgpu_node``; ``init`` of its slots are init containers."""
    inits = [container(f"i{i}", gpu=1) for i in range(init)]
    return gpu_pod(
        name,
        node_name=node_name,
        init=inits,
        phase=phase,
        annotations=allocation(allocated=devices, node=vgpu_node),
    )


def deleting(p: dict[str, Any]) -> dict[str, Any]:
    """``p`` with a deletion timestamp: deleted, in its grace period."""
    return {**p, "metadata": {**p["metadata"], "deletionTimestamp": "2025-01-01T00:00:00Z"}}


def model_of(*nodes: dict[str, Any], pods: Sequence[dict[str, Any]] = ()) -> ClusterModel:
    model = ClusterModel()
    model.replace_nodes(nodes)
    model.replace_pods(pods)
    return model


def used(model: ClusterModel, name: str) -> dict[str, tuple[int, int, int]]:
    return {g.uuid: (g.used_slots, g.used_mem, g.used_cores) for g in model.nodes[NodeName(name)].gpus}


def stamped(seconds_before_now: float, *, allocatable: str = "0") -> dict[str, Any]:
    """A two-GPU node whose handshake is a ``Requesting_`` stamp that old, ``allocatable`` GPUs."""
    when = datetime.fromtimestamp(NOW - seconds_before_now, UTC)
    return builders.node(
        "n",
        TWO_GPUS,
        annotations={keys.NODE_HANDSHAKE: requesting(when)},
        allocatable={keys.RESOURCE_COUNT: allocatable},
    )


# -- a node as registered ------------------------------------------------------------------------


def test_registered_node_starts_with_nothing_used() -> None:
    state, problem = node_from_json(gpu_node("n", TWO_GPUS, annotations={keys.DEVICE_CORDON: "B"}))
    assert problem is None
    assert [(g.uuid, g.used_slots, g.used_mem, g.used_cores, g.cordoned) for g in state.gpus] == [
        ("A", 0, 0, 0, False),
        ("B", 0, 0, 0, True),
    ]
    # B is cordoned: only A offers a slot.
    assert (state.free_slot_gpus, state.max_free_mem, state.score) == (1, 1000, 0.0)
    assert state.usable(NOW)


def test_gpu_is_not_cordoned_unless_told() -> None:
    device = gpu("A")
    assert not Gpu.of(device).cordoned
    plain = Gpu(
        uuid=GpuUuid("A"),
        index=0,
        count=1,
        devmem=1,
        devcore=1,
        type="T",
        type_upper="T",
        numa=0,
        mode="m",
        health=True,
    )
    assert (plain.cordoned, plain.used_slots, plain.used_mem, plain.used_cores) == (False, 0, 0, 0)


def test_node_known_only_from_a_pod_offers_nothing() -> None:
    # A pod event may come before its node's: the node is then a placeholder holding the bad pod.
    model = ClusterModel()
    model.apply_pod("ADDED", running("bad", "late", "GPU-late-0,NVIDIA,-5,0:;"))
    placeholder = model.nodes[NodeName("late")]
    assert not placeholder.registered
    assert not placeholder.usable(NOW)
    assert (placeholder.free_slot_gpus, placeholder.max_free_mem, placeholder.allocatable_gpus) == (0, 0, 0)
    assert NodeState(NodeName("fresh")) == NodeState(
        NodeName("fresh"), registered=False, free_slot_gpus=0, max_free_mem=0
    )
    ask = build_ask(gpu_pod("p"), CONFIG)
    assert (
        decide(model, ask, [NodeName("late")], now=NOW).unresolvable[NodeName("late")].text()
        == "NodeUnregistered"
    )
    # The node registers: it still holds the malformed allocation, so it offers nothing yet.
    model.apply_node("ADDED", gpu_node("late"))
    assert (
        decide(model, ask, [NodeName("late")], now=NOW).failed[NodeName("late")].text()
        == "NodeAllocationUnknown"
    )
    model.apply_pod("DELETED", running("bad", "late", "GPU-late-0,NVIDIA,-5,0:;"))
    assert decide(model, ask, [NodeName("late")], now=NOW).node == "late"


@pytest.mark.parametrize(
    ("change", "usable"),
    [
        pytest.param({}, True, id="registered-and-clean"),
        pytest.param({"registered": False}, False, id="unregistered"),
        pytest.param({"problem": "malformed"}, False, id="malformed-register"),
        pytest.param({"bad_pods": {PodUid("u")}}, False, id="malformed-allocation"),
        pytest.param({"requesting_since": NOW - 60}, False, id="handshake-timed-out"),
    ],
)
def test_node_is_usable_only_when_nothing_is_wrong(change: dict[str, Any], usable: bool) -> None:
    state = NodeState(NodeName("n"), registered=True)
    for field, value in change.items():
        setattr(state, field, value)
    assert state.usable(NOW) is usable


# -- liveness (the handshake rule) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("age_s", "allocatable", "dead"),
    [
        pytest.param(0, "0", False, id="just-stamped"),
        pytest.param(59, "0", False, id="59s-unanswered"),
        pytest.param(60, "0", True, id="60s-unanswered"),
        pytest.param(3600, "0", True, id="an-hour-unanswered"),
        pytest.param(3600, "1", False, id="old-stamp-but-a-gpu-allocatable"),
        pytest.param(3600, "8", False, id="old-stamp-but-gpus-allocatable"),
    ],
)
def test_requesting_stamp_kills_a_node_after_60s_without_allocatable_gpus(
    age_s: float, allocatable: str, dead: bool
) -> None:
    model = model_of(stamped(age_s, allocatable=allocatable))
    assert model.nodes[NodeName("n")].dead(NOW) is dead
    assert model.nodes[NodeName("n")].usable(NOW) is not dead


@pytest.mark.parametrize(
    "handshake",
    [
        pytest.param("Reported_1970-01-01 00:00:00", id="reported"),
        pytest.param("Deleted_1970-01-01 00:00:00", id="deleted"),
        pytest.param("Requesting_yesterday", id="unparsable"),
    ],
)
def test_only_a_requesting_stamp_can_kill_a_node(handshake: str) -> None:
    n = builders.node(
        "n", TWO_GPUS, annotations={keys.NODE_HANDSHAKE: handshake}, allocatable={keys.RESOURCE_COUNT: "0"}
    )
    state = model_of(n).nodes[NodeName("n")]
    assert state.requesting_since is None
    assert not state.dead(NOW)


def test_handshake_change_keeps_the_gpus_and_their_usage() -> None:
    model = model_of(gpu_node("n", TWO_GPUS), pods=[running("a", "n", [[dev("A", 300, 20)]])])
    before = model.nodes[NodeName("n")]
    model.apply_node("MODIFIED", stamped(10))
    after = model.nodes[NodeName("n")]
    assert after is before
    assert after.requesting_since == NOW - 10
    assert after.allocatable_gpus == 0
    assert used(model, "n")["A"] == (1, 300, 20)


# -- the summary a filter ranks and skips by ----------------------------------------------------------


def test_node_score_is_the_sum_of_slot_core_and_memory_ratios() -> None:
    # HAMi's NodeScore: 2/20 slots + 40/200 cores + 500/2000 MiB, before the pod is placed.
    model = model_of(
        gpu_node("n", TWO_GPUS),
        pods=[running("a", "n", [[dev("A", 300, 30)]]), running("b", "n", [[dev("B", 200, 10)]])],
    )
    assert model.nodes[NodeName("n")].score == pytest.approx(0.1 + 0.2 + 0.25)


def test_node_score_ignores_a_dimension_the_node_has_none_of() -> None:
    no_cores = [gpu("A", 0, count=4, mem=1000, core=0)]
    model = model_of(gpu_node("n", no_cores), pods=[running("a", "n", [[dev("A", 500, 0)]])])
    assert model.nodes[NodeName("n")].score == pytest.approx(0.25 + 0.5)


def test_free_slot_gpus_and_freest_memory_count_only_gpus_that_can_take_a_pod() -> None:
    devices = [
        gpu("full", 0, count=1, mem=8000),  # its only slot taken, 7900 MiB free
        gpu("sick", 1, mem=9000, health=False),
        gpu("fenced", 2, mem=9500),
        gpu("half", 3, mem=4000),  # 1500 MiB taken
        gpu("busy", 4, mem=3000),  # 3000 MiB taken: a slot, no memory
    ]
    model = model_of(
        gpu_node("n", devices, annotations={keys.DEVICE_CORDON: "fenced"}),
        pods=[
            running("a", "n", [[dev("full", 100)]]),
            running("b", "n", [[dev("half", 1500)]]),
            running("c", "n", [[dev("busy", 3000)]]),
        ],
    )
    state = model.nodes[NodeName("n")]
    assert (state.free_slot_gpus, state.max_free_mem) == (2, 2500)


def test_a_node_with_every_slot_taken_offers_no_memory() -> None:
    model = model_of(
        gpu_node("n", [gpu("A", 0, count=1, mem=1000)]), pods=[running("a", "n", [[dev("A", 10)]])]
    )
    state = model.nodes[NodeName("n")]
    assert (state.free_slot_gpus, state.max_free_mem) == (0, 0)


def test_a_gpu_with_its_memory_all_taken_offers_zero_not_one() -> None:
    model = model_of(gpu_node("n", [gpu("A", 0, mem=1000)]), pods=[running("a", "n", [[dev("A", 1000)]])])
    state = model.nodes[NodeName("n")]
    assert (state.free_slot_gpus, state.max_free_mem) == (1, 0)


def test_node_type_key_lists_its_gpu_types_once_in_upper_case() -> None:
    devices = [
        gpu("A", 0, type_="NVIDIA-T4"),
        gpu("B", 1, type_="nvidia-a100"),
        gpu("C", 2, type_="NVIDIA-T4"),
    ]
    state, _ = node_from_json(gpu_node("n", devices))
    assert state.type_key == ("NVIDIA-A100", "NVIDIA-T4")


# -- what a pod takes ----------------------------------------------------------------------------------


def test_pod_usage_counts_init_containers_by_peak_and_the_others_summed() -> None:
    devices = [
        [dev("A", 3000, 10)],  # init 1
        [dev("A", 1000, 40), dev("B", 700, 5)],  # init 2
        [dev("A", 500, 5)],  # regular containers, summed
        [dev("A", 600, 6)],
    ]
    assert pod_usage(devices, 2) == {"A": (2, 3000, 40), "B": (1, 700, 5)}
    assert pod_usage(devices, 0) == {"A": (4, 5100, 61), "B": (1, 700, 5)}


USAGE_DEVICES = st.lists(
    st.lists(
        st.builds(
            dev,
            st.sampled_from(["A", "B", "C"]),
            st.integers(min_value=0, max_value=40_000),
            st.integers(min_value=0, max_value=100),
        ),
        max_size=3,
    ),
    max_size=5,
)


def _reference_usage(
    devices: Sequence[Sequence[ContainerDevice]], n_init: int, sidecars: frozenset[int] = frozenset()
) -> dict[str, Dims]:
    """Kubernetes' effective request (KEP-753) per GPU and per dimension: the largest of, for each
    regular init container, it with the sidecars declared before it; and the regular containers
    with every sidecar. Without sidecars: the biggest init container against the regular sum."""

    def of(slot: Sequence[ContainerDevice], uuid: str) -> Dims:
        mine = [d for d in slot if d.uuid == uuid]
        return (len(mine), sum(d.usedmem for d in mine), sum(d.usedcores for d in mine))

    def total(slots: Sequence[Sequence[ContainerDevice]], uuid: str, k: int) -> int:
        return sum(of(slot, uuid)[k] for slot in slots)

    out: dict[str, Dims] = {}
    for uuid in {d.uuid for slot in devices for d in slot}:
        inits = devices[:n_init]
        side = [slot for i, slot in enumerate(inits) if i in sidecars]
        phases = [
            [slot, *(s for j, s in enumerate(inits[:i]) if j in sidecars)]
            for i, slot in enumerate(inits)
            if i not in sidecars
        ]
        phases.append([*devices[n_init:], *side])
        out[uuid] = (
            max(total(phase, uuid, 0) for phase in phases),
            max(total(phase, uuid, 1) for phase in phases),
            max(total(phase, uuid, 2) for phase in phases),
        )
    return out


@settings(max_examples=200, deadline=None)
@given(USAGE_DEVICES, st.integers(min_value=0, max_value=5))
def test_pod_usage_law_peak_of_init_against_sum_of_regular(
    devices: list[list[ContainerDevice]], n_init: int
) -> None:
    assert pod_usage(devices, n_init) == _reference_usage(devices, n_init)


@settings(max_examples=200, deadline=None)
@given(USAGE_DEVICES, st.integers(min_value=0, max_value=5), st.frozensets(st.integers(0, 4)))
def test_pod_usage_law_with_sidecars_is_kubernetes_effective_request(
    devices: list[list[ContainerDevice]], n_init: int, sidecars: frozenset[int]
) -> None:
    sidecars = frozenset(i for i in sidecars if i < n_init)
    assert pod_usage(devices, n_init, sidecars) == _reference_usage(devices, n_init, sidecars)


def test_a_sidecar_is_held_with_the_apps_and_the_init_containers_after_it() -> None:
    devices = [
        [dev("A", 30000, 10)],  # init before the sidecar: alone
        [dev("A", 10000, 20)],  # sidecar: runs to the end
        [dev("A", 25000, 30)],  # init after the sidecar: with it
        [dev("A", 5000, 5)],  # app: with the sidecar
    ]
    assert pod_usage(devices, 3, frozenset({1})) == {"A": (2, 35000, 50)}
    assert pod_usage(devices, 3) == {"A": (1, 30000, 30)}  # as HAMi counts it: under by 5000 MiB
    sidecar_and_app = [[dev("A", 40000, 0)], [dev("A", 40000, 0)]]
    assert pod_usage(sidecar_and_app, 1, frozenset({0})) == {"A": (2, 80000, 0)}


@pytest.mark.parametrize(
    ("p", "finished"),
    [
        pytest.param(gpu_pod("p", phase="Running"), False, id="running"),
        pytest.param(gpu_pod("p", phase="Pending"), False, id="pending"),
        pytest.param(gpu_pod("p", phase="Succeeded"), True, id="succeeded"),
        pytest.param(gpu_pod("p", phase="Failed"), True, id="failed"),
        pytest.param(deleting(gpu_pod("p", phase="Running")), False, id="being-deleted"),
        pytest.param(deleting(gpu_pod("p", phase="Failed")), True, id="deleted-and-stopped"),
        pytest.param({"metadata": {"name": "p"}}, False, id="no-status"),
    ],
)
def test_pod_finished(p: dict[str, Any], finished: bool) -> None:
    assert pod_finished(p) is finished


@pytest.mark.parametrize(
    ("p", "leaving"),
    [
        pytest.param(gpu_pod("p", phase="Running"), False, id="running"),
        pytest.param(gpu_pod("p", phase="Succeeded"), True, id="succeeded"),
        pytest.param(deleting(gpu_pod("p", phase="Running")), True, id="being-deleted"),
        pytest.param({"metadata": {"name": "p"}}, False, id="no-status"),
    ],
)
def test_pod_leaving(p: dict[str, Any], leaving: bool) -> None:
    assert pod_leaving(p) is leaving


def test_allocation_counts_on_spec_node_not_on_vgpu_node() -> None:
    model = model_of(gpu_node("a", TWO_GPUS), gpu_node("b", [gpu("C", 0)]))
    mid_bind = running("p", None, [[dev("A", 100, 10)]], vgpu_node="a", phase="Pending")
    model.apply_pod("ADDED", mid_bind)
    assert used(model, "a")["A"] == (0, 0, 0)
    bound = running("p", "a", [[dev("A", 100, 10)]], vgpu_node="a")
    model.apply_pod("MODIFIED", bound)
    assert used(model, "a")["A"] == (1, 100, 10)
    # Moved elsewhere (a new allocation on node b): a is freed, b counts it.
    model.apply_pod("MODIFIED", running("p", "b", [[dev("C", 50, 5)]]))
    assert used(model, "a")["A"] == (0, 0, 0)
    assert used(model, "b")["C"] == (1, 50, 5)
    assert model.nodes[NodeName("a")].score == 0.0
    assert [c.name for c in model.pods_on(NodeName("b"))] == ["p"]
    assert model.pods_on(NodeName("a")) == []


def test_pod_without_a_node_or_allocation_takes_nothing() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    model.apply_pod("ADDED", gpu_pod("unplaced", annotations=allocation(allocated=[[dev("A", 100)]])))
    model.apply_pod("ADDED", gpu_pod("unallocated", node_name="n"))
    assert model.contributions == {}
    assert used(model, "n")["A"] == (0, 0, 0)


def test_allocation_removed_frees_the_gpu_but_a_reservation_stays() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    model.apply_pod("ADDED", running("held", "n", [[dev("A", 100)]]))
    model.reserve(
        uid=PodUid("uid-ns-planned"),
        namespace="ns",
        name="planned",
        node=NodeName("n"),
        devices=[[dev("B", 200)]],
        n_init=0,
        expires_at=NOW + 60,
    )
    # A failed bind removes the annotations: the allocation goes. A reserved pod's events without
    # an allocation leave its reservation.
    model.apply_pod("MODIFIED", gpu_pod("held", node_name="n", phase="Running"))
    model.apply_pod("MODIFIED", gpu_pod("planned"))
    assert used(model, "n") == {"A": (0, 0, 0), "B": (1, 200, 0)}


def test_same_allocation_seen_again_changes_nothing() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    model.apply_pod("ADDED", running("p", "n", [[dev("A", 100, 10)]]))
    generation = model.generation
    model.apply_pod("MODIFIED", running("p", "n", [[dev("A", 100, 10)]]))
    assert model.generation == generation
    assert used(model, "n")["A"] == (1, 100, 10)
    # A changed allocation replaces the old one, never adds to it.
    model.apply_pod("MODIFIED", running("p", "n", [[dev("A", 300, 30)]]))
    assert used(model, "n")["A"] == (1, 300, 30)


def test_allocation_replaces_a_reservation_of_the_same_pod() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    model.reserve(
        uid=PodUid("uid-ns-p"),
        namespace="ns",
        name="p",
        node=NodeName("n"),
        devices=[[dev("A", 100, 10)]],
        n_init=0,
        expires_at=NOW + 60,
    )
    model.apply_pod("MODIFIED", running("p", "n", [[dev("A", 100, 10)]]))
    assert used(model, "n")["A"] == (1, 100, 10)
    assert model.contributions[PodUid("uid-ns-p")].source == "allocated"
    assert model.expire(NOW + 120) == 0
    assert used(model, "n")["A"] == (1, 100, 10)


@pytest.mark.parametrize("how", ["deleted", "succeeded", "failed", "stopped-while-deleted"])
def test_finished_pod_frees_its_gpus(how: str) -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    p = running("p", "n", [[dev("A", 100, 10)]])
    model.apply_pod("ADDED", p)
    if how == "deleted":
        model.apply_pod("DELETED", p)
    elif how == "stopped-while-deleted":
        model.apply_pod("MODIFIED", deleting({**p, "status": {"phase": "Failed"}}))
    else:
        model.apply_pod("MODIFIED", {**p, "status": {"phase": how.capitalize()}})
    assert used(model, "n")["A"] == (0, 0, 0)
    assert model.contributions == {}
    assert model.nodes[NodeName("n")].free_slot_gpus == 2


def test_pod_being_deleted_holds_its_gpus_until_its_containers_stop() -> None:
    # Its containers run through the grace period: the GPU is not free until the kubelet says so.
    model = model_of(gpu_node("n", TWO_GPUS))
    p = running("p", "n", [[dev("A", 100, 10)]])
    model.apply_pod("ADDED", p)
    model.apply_pod("MODIFIED", deleting(p))
    assert used(model, "n")["A"] == (1, 100, 10)
    model.apply_pod("MODIFIED", deleting({**p, "status": {"phase": "Succeeded"}}))
    assert used(model, "n")["A"] == (0, 0, 0)


def test_malformed_allocation_is_reported_and_blocks_its_node_until_fixed() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    model.apply_pod("ADDED", running("p", "n", [[dev("A", 100)]]))
    problems = model.apply_pod("MODIFIED", running("p", "n", "A,NVIDIA,lots,0:;"))
    assert [(p.kind, p.namespace, p.name, p.uid, p.field) for p in problems] == [
        ("Pod", "ns", "p", "uid-ns-p", f"{keys.DEVICES_ALLOCATED}[0][0].usedmem")
    ]
    # What it held before is unknown now: not counted, and the node offers nothing.
    assert used(model, "n")["A"] == (0, 0, 0)
    assert model.nodes[NodeName("n")].bad_pods == {PodUid("uid-ns-p")}
    assert model.apply_pod("MODIFIED", running("p", "n", [[dev("A", 200)]])) == []
    assert model.nodes[NodeName("n")].bad_pods == set()
    assert used(model, "n")["A"] == (1, 200, 0)


def test_gpu_the_node_no_longer_registers_takes_nothing_from_the_others() -> None:
    gone = [f"G{i}" for i in range(8)]
    kept = [f"K{i}" for i in range(8)]
    everything = [gpu(u, i) for i, u in enumerate(gone + kept)]
    model = model_of(gpu_node("n", everything))
    model.apply_pod("ADDED", running("p", "n", [[dev(u, 100, 1) for u in gone + kept]]))
    model.apply_node("MODIFIED", gpu_node("n", [gpu(u, i) for i, u in enumerate(kept)]))
    assert used(model, "n") == dict.fromkeys(kept, (1, 100, 1))
    # And when the pod goes, the remaining GPUs are freed exactly once.
    model.apply_pod("DELETED", running("p", "n", []))
    assert used(model, "n") == dict.fromkeys(kept, (0, 0, 0))


# -- node events ---------------------------------------------------------------------------------------


def test_register_change_recounts_the_new_gpus_from_the_pods() -> None:
    model = model_of(
        gpu_node("n", TWO_GPUS), pods=[running("p", "n", [[dev("A", 100, 10)], [dev("A", 50, 5)]])]
    )
    model.apply_node("MODIFIED", gpu_node("n", [gpu("A", 0, mem=2000), gpu("B", 1)]))
    assert used(model, "n")["A"] == (2, 150, 15)
    assert model.nodes[NodeName("n")].max_free_mem == 32768


def test_cordon_change_takes_effect_with_usage_kept() -> None:
    model = model_of(gpu_node("n", TWO_GPUS), pods=[running("p", "n", [[dev("A", 100, 10)]])])
    model.apply_node("MODIFIED", gpu_node("n", TWO_GPUS, annotations={keys.DEVICE_CORDON: "A, "}))
    assert [g.cordoned for g in model.nodes[NodeName("n")].gpus] == [True, False]
    assert used(model, "n")["A"] == (1, 100, 10)
    assert model.nodes[NodeName("n")].free_slot_gpus == 1


def test_malformed_register_is_reported_and_offers_nothing() -> None:
    bad = gpu_node("n")
    bad["metadata"]["annotations"][keys.NODE_REGISTER] = "[{not json"
    model = ClusterModel()
    problems = model.apply_node("ADDED", bad)
    assert [(p.kind, p.name, p.uid) for p in problems] == [("Node", "n", "uid-n")]
    state = model.nodes[NodeName("n")]
    assert state.registered
    assert state.problem is not None
    assert state.gpus == []
    assert not state.usable(NOW)


def test_deleted_node_is_forgotten_and_returns_with_its_pods_counted() -> None:
    model = model_of(gpu_node("n", TWO_GPUS), pods=[running("p", "n", [[dev("A", 100, 10)]])])
    assert model.apply_node("DELETED", gpu_node("n", TWO_GPUS)) == []
    assert "n" not in model.nodes
    model.apply_node("ADDED", gpu_node("n", TWO_GPUS))
    assert used(model, "n")["A"] == (1, 100, 10)


def test_unregistered_node_is_known_but_not_registered() -> None:
    model = model_of(builders.node("plain"))
    state = model.nodes[NodeName("plain")]
    assert not state.registered
    assert state.gpus == []


# -- lists (a watch that starts over) ------------------------------------------------------------------


def test_node_relist_forgets_nodes_not_listed() -> None:
    model = model_of(gpu_node("a"), gpu_node("b"))
    bad = gpu_node("c")
    bad["metadata"]["annotations"][keys.NODE_REGISTER] = "nope"
    problems = model.replace_nodes([gpu_node("a"), bad])
    assert sorted(model.nodes) == ["a", "c"]
    assert [p.name for p in problems] == ["c"]


def test_pod_relist_drops_stale_allocations_and_keeps_listed_ones_once() -> None:
    model = model_of(
        gpu_node("n", TWO_GPUS),
        pods=[running("stays", "n", [[dev("A", 100, 10)]]), running("gone", "n", [[dev("B", 200, 20)]])],
    )
    model.reserve(
        uid=PodUid("uid-ns-planned"),
        namespace="ns",
        name="planned",
        node=NodeName("n"),
        devices=[[dev("B", 50, 5)]],
        n_init=0,
        expires_at=NOW + 60,
    )
    # "gone" finished while the watch was down: the new list no longer holds it.
    problems = model.replace_pods([running("stays", "n", [[dev("A", 100, 10)]])])
    assert problems == []
    assert used(model, "n") == {"A": (1, 100, 10), "B": (1, 50, 5)}
    assert sorted(c.name for c in model.pods_on(NodeName("n"))) == ["planned", "stays"]


def test_pod_relist_reports_malformed_and_forgets_bad_pods_not_listed() -> None:
    model = model_of(gpu_node("n", TWO_GPUS), gpu_node("m", TWO_GPUS))
    model.apply_pod("ADDED", running("old-bad", "n", "A,NVIDIA,x,0:;"))
    problems = model.replace_pods([running("new-bad", "m", "A,NVIDIA,y,0:;")])
    assert [p.name for p in problems] == ["new-bad"]
    assert model.nodes[NodeName("n")].bad_pods == set()
    assert model.nodes[NodeName("m")].bad_pods == {PodUid("uid-ns-new-bad")}


@pytest.mark.parametrize(
    ("nodes_listed", "pods_listed", "synced"),
    [
        pytest.param(False, False, False, id="nothing-listed"),
        pytest.param(True, False, False, id="nodes-only"),
        pytest.param(False, True, False, id="pods-only"),
        pytest.param(True, True, True, id="both"),
    ],
)
def test_model_is_synced_once_nodes_and_pods_are_listed(
    nodes_listed: bool, pods_listed: bool, synced: bool
) -> None:
    model = ClusterModel()
    if nodes_listed:
        model.replace_nodes([gpu_node("n")])
    if pods_listed:
        model.replace_pods([])
    assert model.synced is synced


# -- reservations --------------------------------------------------------------------------------------


def reserve(model: ClusterModel, name: str, devices: list[list[ContainerDevice]], expires_at: float) -> None:
    model.reserve(
        uid=PodUid(f"uid-ns-{name}"),
        namespace="ns",
        name=name,
        node=NodeName("n"),
        devices=devices,
        n_init=0,
        expires_at=expires_at,
    )


def test_reservation_expires_at_its_time_not_before() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    reserve(model, "p", [[dev("A", 100)]], NOW + 60)
    reserve(model, "q", [[dev("B", 100)]], NOW + 90)
    assert model.expire(NOW + 59.9) == 0
    assert model.expire(NOW + 60) == 1
    assert used(model, "n") == {"A": (0, 0, 0), "B": (1, 100, 0)}
    assert model.expire(NOW + 1000) == 1
    assert used(model, "n")["B"] == (0, 0, 0)
    assert model.expire(NOW + 2000) == 0


def test_renewed_reservation_outlives_its_first_expiry() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    reserve(model, "p", [[dev("A", 100)]], NOW + 60)
    reserve(model, "p", [[dev("B", 300)]], NOW + 120)
    assert used(model, "n") == {"A": (0, 0, 0), "B": (1, 300, 0)}
    assert model.expire(NOW + 60) == 0
    assert used(model, "n")["B"] == (1, 300, 0)
    assert model.expire(NOW + 120) == 1


def test_release_drops_a_reservation_and_an_allocation_only_when_told() -> None:
    model = model_of(gpu_node("n", TWO_GPUS), pods=[running("held", "n", [[dev("A", 100)]])])
    reserve(model, "p", [[dev("B", 100)]], NOW + 60)
    model.release(PodUid("uid-ns-held"))
    model.release(PodUid("uid-ns-held"), source="binding")
    assert used(model, "n")["A"] == (1, 100, 0)
    model.release(PodUid("uid-ns-p"))
    assert used(model, "n")["B"] == (0, 0, 0)
    model.release(PodUid("uid-ns-held"), source=None)
    assert used(model, "n")["A"] == (0, 0, 0)
    model.release(PodUid("uid-ns-never-seen"), source=None)
    assert model.contributions == {}


def test_allocation_recorded_by_bind_makes_its_watch_event_a_no_op() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    reserve(model, "p", [[dev("A", 100, 10)]], NOW + 60)
    p = running("p", "n", [[dev("A", 100, 10)]])
    raw = p["metadata"]["annotations"][keys.DEVICES_ALLOCATED]
    model.allocate(
        uid=PodUid("uid-ns-p"),
        namespace="ns",
        name="p",
        node=NodeName("n"),
        devices=[[dev("A", 100, 10)]],
        n_init=0,
        raw=raw,
    )
    generation = model.generation
    assert model.apply_pod("MODIFIED", p) == []
    assert model.generation == generation
    assert used(model, "n")["A"] == (1, 100, 10)
    assert model.expire(NOW + 60) == 0


def test_init_containers_of_a_pod_count_by_their_peak() -> None:
    model = model_of(gpu_node("n", TWO_GPUS))
    model.apply_pod("ADDED", running("p", "n", [[dev("A", 900, 50)], [dev("A", 300, 10)]], init=1))
    assert used(model, "n")["A"] == (1, 900, 50)
