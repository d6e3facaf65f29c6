"""Fitting beyond the single-GPU rules (``hamipy.extender.fitting``, pure): what a pod's containers
take from each other, the reasons counted when a pod does not fit, a bind's re-check keeping the
filter's GPUs, and the "could it ever fit" fit on an empty node."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from builders import allocation, container, gpu, gpu_node, gpu_pod
from hypothesis import given, settings
from hypothesis import strategies as st

from hamipy.extender.filtering import build_ask
from hamipy.extender.fitting import Fit, NodeReasons, fit_pod
from hamipy.extender.model import ClusterModel, NodeName, NodeState
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import ContainerDevice, DeviceInfo, PodDevices

CONFIG = Config()
NUMA = {keys.NUMA_BIND: "true"}
SPREAD = {keys.GPU_SCHEDULER_POLICY: "spread"}


def dev(uuid: str, mem: int, cores: int = 0) -> ContainerDevice:
    return ContainerDevice(uuid, keys.DEVICE_VENDOR_NVIDIA, mem, cores)


def state_of(
    devices: Sequence[DeviceInfo],
    *,
    holding: Sequence[Sequence[ContainerDevice]] = (),
    cordon: str | None = None,
) -> NodeState:
    """Node ``n`` with ``devices`` (``cordon``: the GPUs its device-cordon names), and a running pod
    holding ``holding`` (one slot each) on it."""
    model = ClusterModel()
    model.replace_nodes(
        [gpu_node("n", devices, annotations={keys.DEVICE_CORDON: cordon} if cordon else None)]
    )
    model.replace_pods(
        [gpu_pod("other", node_name="n", phase="Running", annotations=allocation(allocated=holding))]
        if holding
        else []
    )
    return model.nodes[NodeName("n")]


def fit(
    state: NodeState,
    *containers: dict[str, Any],
    annotations: dict[str, str] | None = None,
    init: Sequence[dict[str, Any]] = (),
    empty: bool = False,
    preferred: PodDevices | None = None,
) -> Fit:
    ask = build_ask(gpu_pod("p", *containers, init=init, annotations=annotations), CONFIG)
    return fit_pod(state, ask, empty=empty, preferred=preferred)


def uuids(result: Fit) -> list[list[str]]:
    assert result.devices is not None, result.why().text()
    return [[d.uuid for d in slot] for slot in result.devices]


# -- the summary of a pod's asks (the filter skips nodes by it) ---------------------------------------


@pytest.mark.parametrize(
    ("containers", "init", "most"),
    [
        pytest.param(
            [container("a", gpu=2, gpumem=500), container("plain")],
            [container("i", gpu=1, gpumem=3000)],
            (2, 3000),
            id="largest-of-every-container",
        ),
        pytest.param(
            [container("a", gpu=1, gpumem_percentage=50)], [], (1, 0), id="percentage-is-no-fixed-mib"
        ),
        pytest.param(
            [container("a", gpu=1, gpumem_percentage=50), container("b", gpu=1, gpumem=700)],
            [],
            (1, 700),
            id="percentage-beside-mib",
        ),
        pytest.param([container("plain")], [], (0, 0), id="no-gpu-asked"),
    ],
)
def test_pod_ask_summary_is_the_most_any_one_container_asks(
    containers: list[dict[str, Any]], init: list[dict[str, Any]], most: tuple[int, int]
) -> None:
    ask = build_ask(gpu_pod("p", *containers, init=init), CONFIG)
    assert (ask.max_count, ask.max_memory_mib) == most


# -- what a pod's containers take from each other -----------------------------------------------------


def test_core_check_counts_cores_already_in_use() -> None:
    state = state_of([gpu("A", 0, core=100)], holding=[[dev("A", 100, 60)]])
    assert fit(state, container(gpu=1, gpumem=10, gpucores=50)).why() == NodeReasons.of_gpus(
        Counter({"CardInsufficientCore": 1}), 1
    )
    assert uuids(fit(state, container(gpu=1, gpumem=10, gpucores=40))) == [["A"]]


def test_second_container_finds_the_first_ones_slot_taken() -> None:
    one_slot = state_of([gpu("A", 0, count=1)])
    two = (container("a", gpu=1, gpumem=10), container("b", gpu=1, gpumem=10))
    assert fit(one_slot, *two).why().text() == "1/1 CardTimeSlicingExhausted"
    two_slots = state_of([gpu("A", 0, count=2)])
    assert uuids(fit(two_slots, *two)) == [["A"], ["A"]]


def test_second_container_finds_the_first_ones_cores_taken() -> None:
    one = state_of([gpu("A", 0)])
    two = (container("a", gpu=1, gpumem=10, gpucores=60), container("b", gpu=1, gpumem=10, gpucores=60))
    assert fit(one, *two).why().text() == "1/1 CardInsufficientCore"
    # With a second GPU the second container goes there.
    assert sorted(u for slot in uuids(fit(state_of([gpu("A", 0), gpu("B", 1)]), *two)) for u in slot) == [
        "A",
        "B",
    ]


def test_containers_record_what_each_took() -> None:
    state = state_of([gpu("A", 0, mem=1000), gpu("B", 1, mem=1000)])
    result = fit(
        state, container("a", gpu=2, gpumem=300, gpucores=30), container("b", gpu=1, gpumem_percentage=50)
    )
    assert result.devices is not None
    assert [[(d.uuid, d.type, d.usedmem, d.usedcores) for d in slot] for slot in result.devices] == [
        [("A", "NVIDIA", 300, 30), ("B", "NVIDIA", 300, 30)],
        [("A", "NVIDIA", 500, 0)],
    ]


GPU_SHAPES = st.lists(
    st.builds(
        lambda count, mem, core: (count, mem, core),
        st.integers(min_value=1, max_value=3),
        st.sampled_from([1000, 2000]),
        st.sampled_from([50, 100]),
    ),
    min_size=1,
    max_size=3,
)
CONTAINERS = st.lists(
    st.builds(
        lambda n, mem, cores: container(gpu=n, gpumem=mem, gpucores=cores),
        st.integers(min_value=1, max_value=2),
        st.integers(min_value=1, max_value=1200),
        st.sampled_from([0, 10, 40, 60, 100]),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(GPU_SHAPES, CONTAINERS, st.integers(min_value=0, max_value=3))
def test_fit_law_a_pods_containers_never_overfill_a_gpu(
    shapes: list[tuple[int, int, int]], containers: list[dict[str, Any]], n_init: int
) -> None:
    devices = [gpu(f"G{i}", i, count=c, mem=m, core=k) for i, (c, m, k) in enumerate(shapes)]
    state = state_of(devices)
    n_init = min(n_init, len(containers) - 1)  # a pod has a regular container
    inits, apps = containers[:n_init], containers[n_init:]
    result = fit(state, *apps, init=inits)
    if result.devices is None:
        return
    capacity = {d.id: (d.count, d.devmem, d.devcore) for d in devices}

    def within(slots: Sequence[Sequence[ContainerDevice]]) -> bool:
        taken: dict[str, list[int]] = {}
        for slot in slots:
            assert len({d.uuid for d in slot}) == len(slot)  # a container's GPUs are distinct
            for d in slot:
                acc = taken.setdefault(d.uuid, [0, 0, 0])
                acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + d.usedmem, acc[2] + d.usedcores
        return all(all(t <= c for t, c in zip(acc, capacity[u], strict=True)) for u, acc in taken.items())

    assert within(result.devices[len(inits) :])  # regular containers run together
    assert all(within([slot]) for slot in result.devices[: len(inits)])  # init containers one at a time
    asked = [int(c["resources"]["limits"][keys.RESOURCE_COUNT]) for c in containers]
    assert [len(slot) for slot in result.devices] == asked


# -- reasons, counted ---------------------------------------------------------------------------------


def test_fewer_fitting_gpus_than_asked_counts_the_ones_that_fit() -> None:
    state = state_of([gpu("A", 0), gpu("B", 1)], cordon="A")
    assert fit(state, container(gpu=2, gpumem=10)).why() == NodeReasons.of_gpus(
        Counter({"CardCordoned": 1, "AllocatedCardsInsufficientRequest": 1}), 2
    )


NUMA_GPUS = [gpu("A", 0, numa=0), gpu("B", 1, numa=1), gpu("C", 2, numa=1)]


@pytest.mark.parametrize(
    ("sick", "ask", "reasons"),
    [
        pytest.param("C", container(gpu=2, gpumem=10), {"CardNotHealth": 1, "NumaNotFit": 1}, id="fit-apart"),
        pytest.param("", container(gpu=3, gpumem=10), {"NumaNotFit": 2}, id="enough-but-on-two-numa-nodes"),
        pytest.param(
            "A",
            container(gpu=3, gpumem=10),
            {"CardNotHealth": 1, "AllocatedCardsInsufficientRequest": 2},
            id="too-few-fit-at-all",
        ),
        pytest.param("", container(gpu=2, gpumem=99999), {"CardInsufficientMemory": 3}, id="none-fits"),
    ],
)
def test_numa_bind_reasons_say_whether_numa_or_capacity_failed(
    sick: str, ask: dict[str, Any], reasons: dict[str, int]
) -> None:
    devices = [gpu(d.id, d.index, numa=d.numa, health=d.id != sick) for d in NUMA_GPUS]
    assert fit(state_of(devices), ask, annotations=NUMA).why() == NodeReasons.of_gpus(Counter(reasons), 3)


def test_numa_bind_places_on_one_numa_node() -> None:
    result = fit(state_of(NUMA_GPUS), container(gpu=2, gpumem=10), annotations={**NUMA, **SPREAD})
    assert sorted(uuids(result)[0]) == ["B", "C"]


def test_fit_failed_without_a_counted_cause_says_node_unfit_pod() -> None:
    assert Fit(None, Counter(), 2).why() == NodeReasons((("NodeUnfitPod", 1),), 0)


def test_node_level_reasons_count_one_and_no_gpus() -> None:
    assert NodeReasons.of_node("NodeUnregistered") == NodeReasons((("NodeUnregistered", 1),))
    assert NodeReasons((("NodeUnregistered", 1),)).text() == "NodeUnregistered"


# -- a re-check keeps the filter's GPUs (preferred) ----------------------------------------------------


def test_recheck_keeps_the_preferred_gpus_while_they_fit() -> None:
    state = state_of([gpu("A", 0), gpu("B", 1), gpu("C", 2)])
    one = container(gpu=1, gpumem=10)
    assert uuids(fit(state, one, annotations=SPREAD)) == [["A"]]
    assert uuids(fit(state, one, annotations=SPREAD, preferred=[[dev("B", 10)]])) == [["B"]]
    two = container(gpu=2, gpumem=10)
    assert uuids(fit(state, two, annotations=SPREAD, preferred=[[dev("C", 10), dev("B", 10)]])) == [
        ["C", "B"]
    ]


def test_recheck_replans_when_a_preferred_gpu_no_longer_fits() -> None:
    state = state_of([gpu("A", 0, count=1), gpu("B", 1), gpu("C", 2)], holding=[[dev("A", 10)]])
    result = fit(state, container(gpu=1, gpumem=10), annotations=SPREAD, preferred=[[dev("A", 10)]])
    assert uuids(result) == [["B"]]


def test_recheck_ignores_preferred_gpus_the_node_no_longer_has() -> None:
    state = state_of([gpu("A", 0), gpu("B", 1)])
    result = fit(
        state, container(gpu=1, gpumem=10), annotations=SPREAD, preferred=[[dev("GONE", 10), dev("B", 10)]]
    )
    assert uuids(result) == [["B"]]


def test_recheck_with_fewer_preferred_slots_than_containers_plans_the_rest() -> None:
    state = state_of([gpu("A", 0), gpu("B", 1)])
    two = (container("a", gpu=1, gpumem=10), container("b", gpu=1, gpumem=10))
    result = fit(state, *two, annotations={keys.GPU_SCHEDULER_POLICY: "binpack"}, preferred=[[dev("B", 10)]])
    assert uuids(result) == [["B"], ["B"]]


# -- could it ever fit: the fit on an empty node -------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "holding", "ask", "ever"),
    [
        pytest.param(gpu("A", count=0), [], container(gpu=1, gpumem=10), False, id="no-slots-at-all"),
        pytest.param(
            gpu("A", mem=1000), [[dev("A", 1000)]], container(gpu=1), True, id="whole-gpu-once-freed"
        ),
        pytest.param(
            gpu("A", mem=1000), [], container(gpu=1, gpumem=1001), False, id="more-memory-than-the-gpu"
        ),
        pytest.param(
            gpu("A"),
            [[dev("A", 10, 10)]],
            container(gpu=1, gpumem=10, gpucores=100),
            True,
            id="exclusive-once-freed",
        ),
        pytest.param(
            gpu("A", core=50),
            [],
            container(gpu=1, gpumem=10, gpucores=51),
            False,
            id="more-cores-than-the-gpu",
        ),
    ],
)
def test_empty_fit_ignores_what_is_used_now(
    device: DeviceInfo, holding: list[list[ContainerDevice]], ask: dict[str, Any], ever: bool
) -> None:
    state = state_of([device], holding=holding)
    assert not fit(state, ask).ok
    assert fit(state, ask, empty=True).ok is ever
