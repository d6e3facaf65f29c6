"""HAMi's GPU policies ``mutex``, ``numa`` and ``topology-aware`` (``scoring.GpuRule``, the fit),
with HAMi's own test cases carried over as data (pkg/scheduler/policy/gpu_policy_test.go,
pkg/device/nvidia/device_test.go, pkg/scheduler/score_test.go, numa_sort_test.go, util_test.go).

HAMi sorts a node's GPUs and walks the sorted list from its end; here the GPUs are ranked best
first. So HAMi's ``Less(a, b) == true`` (a sorts before b) reads "b is tried before a", and the
GPUs a HAMi fit returns in its walk order come back here in the policy's order: the cases assert
the set where HAMi's order is an artifact of that walk."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
from builders import container, gpu, gpu_node, gpu_pod

from hamipy.extender.filtering import build_ask, decide
from hamipy.extender.fitting import fit_pod
from hamipy.extender.model import ClusterModel, Gpu, NodeName, NodeState
from hamipy.extender.scoring import GpuRule, rank
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.node_scores import encode_node_scores
from hamipy.protocol.pod_preferences import parse_gpu_policy

NOW = 1_000_000.0
POLICY = keys.GPU_SCHEDULER_POLICY

# -- the order: TestDeviceUsageList_Less ------------------------------------------------------------

# (name, policy, numaBind, a, b, Less(a, b)); a device is "field=value ...", missing fields 0.
LESS: list[tuple[str, str, bool, str, str, bool]] = [
    ("Binpack policy with same Numa",
     "binpack", False, "used=10 score=10", "used=20 score=20", True),
    ("Binpack: score primary, lower score sorts first across NUMA",
     "binpack", False, "numa=1 used=10 score=10", "numa=0 used=20 score=20", True),
    ("Binpack: score primary, higher score sorts last even on lower NUMA",
     "binpack", False, "numa=0 used=10 score=10", "numa=1 used=20 score=20", True),
    ("Binpack: NUMA tiebreaker when scores equal",
     "binpack", False, "numa=0 score=15", "numa=1 score=15", True),
    ("Binpack: score primary over NUMA, high-NUMA high-score sorts last",
     "binpack", False, "numa=1 score=20", "numa=0 score=10", False),
    ("Spread: score primary, higher score sorts first",
     "spread", False, "used=10 score=10", "used=20 score=20", False),
    ("Spread: score primary, lower score sorts last across NUMA",
     "spread", False, "numa=1 used=10 score=10", "numa=0 used=20 score=20", False),
    ("Spread: score primary over NUMA, high-NUMA high-score sorts first",
     "spread", False, "numa=1 score=20", "numa=0 score=10", True),
    ("Spread: NUMA tiebreaker when scores equal",
     "spread", False, "numa=0 score=15", "numa=1 score=15", True),
    ("Binpack+NumaBind: NUMA primary, higher NUMA sorts first regardless of Score",
     "binpack", True, "numa=1 score=5", "numa=0 score=99", True),
    ("Binpack+NumaBind: same NUMA falls back to lower Score first",
     "binpack", True, "score=10", "score=20", True),
    ("Spread+NumaBind: NUMA primary, lower NUMA sorts first regardless of Score",
     "spread", True, "numa=0 score=5", "numa=1 score=99", True),
    ("Spread+NumaBind: same NUMA falls back to higher Score first",
     "spread", True, "score=20", "score=10", True),
    ("Mutex: busy GPU sorts before idle GPU",
     "mutex", False, "used=2", "used=0", True),
    ("Mutex: idle GPU sorts after busy GPU",
     "mutex", False, "used=0", "used=1", False),
    ("Mutex: NUMA tiebreaker when both idle",
     "mutex", False, "numa=0", "numa=1", True),
    ("Bare numa: NUMA is the sort key regardless of score",
     "numa", False, "numa=0 score=99", "numa=1 score=5", True),
    ("Bare numa: same NUMA falls to deterministic Index tiebreak",
     "numa", False, "index=3 score=10", "index=1 score=20", False),
    ("Chain binpack,numa: score primary, numa tiebreak when scores equal",
     "binpack,numa", False, "numa=0 score=15", "numa=1 score=15", True),
    ("Chain spread,numa: score primary, numa tiebreak when scores equal",
     "spread,numa", False, "numa=0 score=15", "numa=1 score=15", True),
    ("Chain numa,spread: numa primary regardless of score",
     "numa,spread", False, "numa=1 score=5", "numa=0 score=99", False),
    ("Chain numa,spread: same NUMA falls back to spread (higher score first)",
     "numa,spread", False, "score=20", "score=10", True),
    ("Chain mutex,spread: mutex is a Fit() filter, not a sort key; spread decides order",
     "mutex,spread", False, "used=5 score=10", "used=0 score=20", False),
    ("Chain with only filter tokens (mutex,topology-aware) falls back to spread",
     "mutex,topology-aware", False, "score=10", "score=20", False),
    ("Chain binpack,numa: deterministic Index tiebreak when score and numa both tie",
     "binpack,numa", False, "index=5 score=10", "index=2 score=10", False),
    ("Chain binpack,spread + NumaBind: numa forced primary to keep groups contiguous",
     "binpack,spread", True, "numa=0 score=99", "numa=1 score=5", True),
    ("Chain spread,numa + NumaBind: numa moved to front, spread breaks same-NUMA ties",
     "spread,numa", True, "score=20", "score=10", True),
]  # fmt: skip

# numa-bind does not reorder GPUs here: it takes the first NUMA node, in the policy's order, with
# enough GPUs fitting (the group holding the best GPU), where HAMi sorts NUMA first to make its
# walk meet each node's GPUs in a row and so tries one NUMA end first, however busy its GPUs are.
NUMA_BIND_ORDER_DIFFERS = {
    "Spread+NumaBind: NUMA primary, lower NUMA sorts first regardless of Score",
    "Chain binpack,spread + NumaBind: numa forced primary to keep groups contiguous",
}


def fields(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (item.split("=") for item in text.split())}


def device(uuid: str, fields: Mapping[str, int]) -> Gpu:
    return dataclasses.replace(
        Gpu.of(gpu(uuid, fields.get("index", 0), numa=fields.get("numa", 0))),
        used_slots=fields.get("used", 0),
    )


def tried_first(policy: str, a_text: str, b_text: str) -> str:
    a, b = fields(a_text), fields(b_text)
    gpus = [device("a", a), device("b", b)]
    used = [[g.used_slots, 0, 0] for g in gpus]
    order = rank(
        gpus, used, [a.get("score", 0), b.get("score", 0)], rule=GpuRule.of(parse_gpu_policy(policy))
    )
    return gpus[order[0]].uuid


@pytest.mark.parametrize(
    ("policy", "numa_bind", "a", "b", "less"),
    [pytest.param(*case[1:], id=case[0]) for case in LESS if case[0] not in NUMA_BIND_ORDER_DIFFERS],
)
def test_hamis_order(policy: str, numa_bind: bool, a: str, b: str, less: bool) -> None:
    assert tried_first(policy, a, b) == ("b" if less else "a")


@pytest.mark.parametrize(
    ("policy", "a", "b"),
    [
        pytest.param(case[1], case[3], case[4], id=case[0])
        for case in LESS
        if case[0] in NUMA_BIND_ORDER_DIFFERS
    ],
)
def test_numa_bind_keeps_the_policys_order(policy: str, a: str, b: str) -> None:
    # The policy's favourite comes first; numa-bind then takes its NUMA node if enough GPUs fit there.
    assert tried_first(policy, a, b) == "a"


@pytest.mark.parametrize(
    ("policy", "rule"),
    [
        ("spread", GpuRule(("spread", "numa"))),
        ("binpack", GpuRule(("binpack", "numa"))),
        ("topology-aware", GpuRule(("spread", "numa"), topology=True)),
        ("mutex", GpuRule(("idle", "numa"), mutex=True)),
        ("numa", GpuRule(("numa",), chained=True)),
        ("mutex,spread", GpuRule(("spread",), chained=True, mutex=True)),
        ("spread,numa,mutex", GpuRule(("spread", "numa"), chained=True, mutex=True)),
        ("mutex, spread, numa", GpuRule(("spread", "numa"), chained=True, mutex=True)),
        ("binpack,spread,numa", GpuRule(("binpack", "spread", "numa"), chained=True)),
        ("topology-aware,binpack", GpuRule(("binpack",), chained=True, topology=True)),
        ("mutex,topology-aware", GpuRule(("spread",), chained=True, mutex=True, topology=True)),
    ],
)
def test_a_chain_names_its_keys_and_filters(policy: str, rule: GpuRule) -> None:
    # TestPolicyContains, as the rules the chain makes.
    assert GpuRule.of(parse_gpu_policy(policy)) == rule


@pytest.mark.parametrize(
    ("annotation", "configured", "keys_"),
    [
        pytest.param(None, "binpack", ("binpack", "numa"), id="no annotation: the configured policy"),
        pytest.param("spread", "binpack", ("spread", "numa"), id="with annotation: the pod's"),
        pytest.param("numa", "binpack", ("numa",), id="the pod's chain whole, not merged"),
    ],
)
def test_the_pods_policy_else_the_configured_one(
    annotation: str | None, configured: str, keys_: tuple[str, ...]
) -> None:
    # TestGetGPUSchedulerPolicyByPod.
    annotations = {POLICY: annotation} if annotation else {}
    config = Config.model_validate({"gpu_scheduler_policy": configured})
    assert build_ask(gpu_pod("p", annotations=annotations), config).gpu_rule.keys == keys_


# -- the fit: device_test.go, score_test.go, numa_sort_test.go ---------------------------------------


def std(uuid: str, index: int = 0, **fields: int) -> Gpu:
    """HAMi's standard device: 10 slots, 8192 MiB, 100 cores; ``used``/``usedmem``/``usedcores``."""
    g = Gpu.of(
        gpu(
            uuid,
            index,
            count=fields.get("count", 10),
            mem=fields.get("totalmem", 8192),
            core=fields.get("totalcore", 100),
            numa=fields.get("numa", 0),
        )
    )
    return dataclasses.replace(
        g,
        used_slots=fields.get("used", 0),
        used_mem=fields.get("usedmem", 0),
        used_cores=fields.get("usedcores", 0),
    )


def node_of(gpus: list[Gpu], scores: Mapping[str, Mapping[str, int]] | None = None) -> NodeState:
    state = NodeState(NodeName("n"), gpus=gpus, by_uuid={g.uuid: g for g in gpus}, registered=True)
    state.pair_scores = {a: dict(row) for a, row in (scores or {}).items()}
    return state


def ask(
    annotations: Mapping[str, str], *, nums: int, memreq: int = 100, coresreq: int = 10, weights: str = ""
) -> Any:
    extra = {keys.DEVICE_SCORING_WEIGHTS: weights} if weights else {}
    asked = container(
        gpu=nums, gpumem=memreq or None, gpumem_percentage=None if memreq else 40, gpucores=coresreq
    )
    return build_ask(gpu_pod("p", asked, annotations={**annotations, **extra}), Config())


def chosen(node: NodeState, the_ask: Any) -> list[str] | None:
    fit = fit_pod(node, the_ask)
    return None if fit.devices is None else [d.uuid for d in fit.devices[0]]


TOPOLOGY = {POLICY: "topology-aware"}
MUTEX = {POLICY: "mutex"}
THREE = [std("dev-0", 0), std("dev-1", 1), std("dev-2", 2)]
THREE_SCORES = {
    "dev-0": {"dev-1": 100, "dev-2": 200},
    "dev-1": {"dev-0": 100, "dev-2": 150},
    "dev-2": {"dev-0": 200, "dev-1": 150},
}
NEGATIVE = {
    "dev-0": {"dev-1": -5, "dev-2": -3},
    "dev-1": {"dev-0": -5, "dev-2": -1},
    "dev-2": {"dev-0": -3, "dev-1": -1},
}
ZERO = {a: dict.fromkeys(row, 0) for a, row in THREE_SCORES.items()}


@pytest.mark.parametrize(
    ("gpus", "scores", "annotations", "nums", "want"),
    [
        pytest.param(
            [std("dev-0", 0), std("dev-1", 1)],
            None,
            TOPOLOGY,
            2,
            {"dev-0", "dev-1"},
            id="TestFit_TopologyExactMatch",
        ),
        pytest.param(THREE, THREE_SCORES, TOPOLOGY, 1, {"dev-1"}, id="TestFit_TopologyWorstSingleCard"),
        pytest.param(
            THREE, THREE_SCORES, TOPOLOGY, 2, {"dev-0", "dev-2"}, id="TestFit_TopologyBestCombination"
        ),
        pytest.param(
            THREE, ZERO, TOPOLOGY, 2, {"dev-0", "dev-1"}, id="TestFit_TopologyBestCombinationZeroScores"
        ),
        pytest.param(THREE, NEGATIVE, TOPOLOGY, 1, {"dev-0"}, id="TestFit_TopologyNegativeScores/SingleGPU"),
        pytest.param(
            THREE, NEGATIVE, TOPOLOGY, 2, {"dev-1", "dev-2"}, id="TestFit_TopologyNegativeScores/MultiGPU"
        ),
        pytest.param(
            [std("used", 0, used=1), std("idle", 1)], None, MUTEX, 1, {"idle"}, id="TestFit_MutexPolicy/one"
        ),
        pytest.param(
            [std("dev-0", 0, numa=1), std("dev-1", 1, numa=1), std("dev-2", 2, numa=0)],
            None,
            {keys.NUMA_BIND: "true"},
            2,
            {"dev-0", "dev-1"},
            id="TestFit_NumaSwitching",
        ),
    ],
)
def test_hamis_fit_cases(
    gpus: list[Gpu],
    scores: Mapping[str, Mapping[str, int]] | None,
    annotations: Mapping[str, str],
    nums: int,
    want: set[str],
) -> None:
    got = chosen(node_of(gpus, scores), ask(annotations, nums=nums))
    assert got is not None
    assert (set(got), len(got)) == (want, nums)


@pytest.mark.parametrize(
    ("gpus", "annotations", "memreq", "coresreq", "reasons"),
    [
        pytest.param(
            [std("used", 0, used=1), std("idle", 1)],
            MUTEX,
            100,
            10,
            "1/2 AllocatedCardsInsufficientRequest, 1/2 ExclusiveDeviceAllocateConflict",
            id="TestFit_MutexPolicy/two",
        ),
        pytest.param(
            [std("dev-0", 0, used=20, count=100, totalmem=1280)],
            {},
            512,
            100,
            "1/1 ExclusiveDeviceAllocateConflict",
            id="TestDevices_Fit/card exclusively",
        ),
    ],
)
def test_hamis_fit_failures(
    gpus: list[Gpu], annotations: Mapping[str, str], memreq: int, coresreq: int, reasons: str
) -> None:
    nums = 2 if len(gpus) == 2 else 1
    fit = fit_pod(node_of(gpus), ask(annotations, nums=nums, memreq=memreq, coresreq=coresreq))
    assert fit.devices is None
    assert fit.why().text() == reasons


SIX = ["a", "b", "c", "d", "e", "f"]


def six() -> list[Gpu]:
    """Test_Nvidia_GPU_Topology's devices: 1 of 4 slots, 2048 MiB and 1 core used; a, b on NUMA 0."""
    return [std(u, 0, numa=0 if u in "ab" else 1, used=1, count=4, usedmem=2048, usedcores=1) for u in SIX]


def linked(strong: dict[tuple[str, str], int], weak: int) -> dict[str, dict[str, int]]:
    return {a: {b: strong.get((a, b), strong.get((b, a), weak)) for b in SIX if b != a} for a in SIX}


@pytest.mark.parametrize(
    ("nums", "scores", "want"),
    [
        pytest.param(
            3,
            linked({("a", "f"): 100, ("c", "f"): 100}, 1),
            {"a", "c", "f"},
            id="test nvidia gpu topology-aware",
        ),
        pytest.param(
            1,
            linked({("f", u): 1 for u in "abcde"}, 100),
            {"f"},
            id="test Single Card Topology",
        ),
    ],
)
def test_hamis_score_cases(nums: int, scores: dict[str, dict[str, int]], want: set[str]) -> None:
    # Test_Nvidia_GPU_Topology: HAMi returns the three as [f, c, a], its walk from the list's end.
    the_ask = ask(TOPOLOGY, nums=nums, memreq=1024, coresreq=20)
    fit = fit_pod(node_of(six(), scores), the_ask)
    assert fit.devices is not None
    assert {d.uuid for d in fit.devices[0]} == want
    assert {(d.usedmem, d.usedcores) for d in fit.devices[0]} == {(1024, 20)}


@pytest.mark.parametrize(
    ("weights", "want"),
    [
        pytest.param("", "gpu-b", id="even weights: scores a=16, b=15"),
        pytest.param("slot=1,core=1,memory=3", "gpu-a", id="a=26, b=27"),
    ],
)
def test_equal_topology_totals_go_to_the_policys_favourite(weights: str, want: str) -> None:
    # TestCalcScoreUsesDeviceScoringWeightsAsTopologyTieBreaker.
    gpus = [
        std("gpu-a", 0, count=10, used=1, usedcores=90, totalmem=100, usedmem=10),
        std("gpu-b", 1, count=10, used=7, usedcores=10, totalmem=100, usedmem=20),
    ]
    node = node_of(gpus, {"gpu-a": {"gpu-b": 1}, "gpu-b": {"gpu-a": 1}})
    assert chosen(node, ask(TOPOLOGY, nums=1, memreq=0, coresreq=0, weights=weights)) == [want]


@pytest.mark.parametrize(
    ("used", "want"),
    [
        pytest.param(
            {"A_n0": 5, "B_n0": 1, "C_n1": 3}, {"A_n0", "B_n0"}, id="TestNumaBindSortPreservesAffinity"
        ),
    ],
)
def test_numa_bind_takes_one_numa_node(used: dict[str, int], want: set[str]) -> None:
    gpus = [std(u, i, numa=int(u[-1]), used=used[u]) for i, u in enumerate(used)]
    assert set(chosen(node_of(gpus), ask({keys.NUMA_BIND: "true"}, nums=2)) or ()) == want


def test_score_primary_selects_across_numa() -> None:
    # TestScorePrimarySelectsAcrossNuma: the scores 1/8/5 as slots used.
    gpus = [std("P_n0", 0, numa=0, used=1), std("Q_n1", 1, numa=1, used=8), std("R_n1", 2, numa=1, used=5)]
    assert chosen(node_of(gpus), ask({POLICY: "spread"}, nums=1)) == ["P_n0"]


# -- behaviour on a node as the device plugin registers it ------------------------------------------


def pcie_pairs8() -> dict[str, dict[str, int]]:
    """The pair scores of the fake driver's ``pcie-pairs8``: GPUs 2k, 2k+1 bridged (12 NVLinks, one
    PCIe switch: 1250); NODE (20) within a NUMA node (GPUs 0-3, 4-7), SYS (10) across."""
    return {
        f"GPU-{i}": {
            f"GPU-{j}": 1250 if j == i ^ 1 else 20 if i // 4 == j // 4 else 10 for j in range(8) if j != i
        }
        for i in range(8)
    }


def pairs_node(name: str = "n", *, scores: str | None = None) -> dict[str, Any]:
    devices = [gpu(f"GPU-{i}", i, numa=i // 4) for i in range(8)]
    value = encode_node_scores(pcie_pairs8()) if scores is None else scores
    return gpu_node(name, devices, annotations={keys.NODE_SCORE: value})


def model_with(*nodes: dict[str, Any]) -> ClusterModel:
    model = ClusterModel()
    model.replace_nodes(nodes)
    model.replace_pods([])
    return model


def place(model: ClusterModel, pod: dict[str, Any], config: Config | None = None) -> Any:
    decision = decide(model, build_ask(pod, config or Config()), list(model.nodes), now=NOW)
    if decision.devices is not None:
        assert decision.node is not None
        meta = pod["metadata"]
        model.reserve(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            node=NodeName(decision.node),
            devices=decision.devices,
            n_init=0,
            expires_at=NOW + 60,
        )
    return decision


def test_a_topology_aware_pod_on_the_pcie_pairs_node_gets_a_bridged_pair() -> None:
    model = model_with(pairs_node())
    for i in range(4):
        pod = gpu_pod(f"p{i}", container(gpu=2, gpumem=1000), annotations=TOPOLOGY)
        got = sorted(d.uuid for d in place(model, pod).devices[0])
        first = int(got[0].removeprefix("GPU-"))
        assert first % 2 == 0, got
        assert got == [f"GPU-{first}", f"GPU-{first + 1}"]


def test_a_spread_pod_on_the_pcie_pairs_node_may_take_two_unbridged_gpus() -> None:
    # What topology-aware is for: spread takes the two idlest, 5 and 6 once 4 is used.
    model = model_with(pairs_node())
    place(model, gpu_pod("one", container(gpu=1, gpumem=1000), annotations={POLICY: "spread"}))
    spread = place(model, gpu_pod("p", container(gpu=2, gpumem=1000)))
    topo = decide(model, ask(TOPOLOGY, nums=2, memreq=1000), [NodeName("n")], now=NOW)
    assert spread.devices is not None
    assert topo.devices is not None
    assert {d.uuid for d in spread.devices[0]} == {"GPU-5", "GPU-6"}
    a, b = sorted(int(d.uuid.removeprefix("GPU-")) for d in topo.devices[0])
    assert (a % 2, b) == (0, a + 1), "a bridged pair"


def test_a_cluster_default_of_topology_aware_places_pods() -> None:
    config = Config.model_validate({"gpu_scheduler_policy": "topology-aware"})
    model = model_with(pairs_node("a"), gpu_node("b", [gpu("GPU-b0", 0), gpu("GPU-b1", 1)]))
    for i in range(6):
        decision = place(model, gpu_pod(f"p{i}", container(gpu=2, gpumem=1000)), config)
        assert decision.node is not None, decision.failed


def test_a_mutex_pod_never_joins_a_used_gpu_and_a_later_pod_may_join_it() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0), gpu("B", 1)]))
    place(model, gpu_pod("first", container(gpu=1, gpumem=1000)))
    mutex = place(model, gpu_pod("m", container(gpu=1, gpumem=1000), annotations=MUTEX))
    (taken,) = {d.uuid for d in mutex.devices[0]}
    refused = place(model, gpu_pod("m2", container(gpu=1, gpumem=1000), annotations=MUTEX))
    assert refused.node is None
    later = place(model, gpu_pod("later", container(gpu=2, gpumem=1000)))
    assert taken in {d.uuid for d in later.devices[0]}, "one-sided: a pod without mutex may join"


def test_a_mutex_pod_is_told_why_no_gpu_is_free() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0), gpu("B", 1)]))
    place(model, gpu_pod("first", container(gpu=2, gpumem=1000)))
    refused = place(model, gpu_pod("m", container(gpu=1, gpumem=1000), annotations=MUTEX))
    assert refused.failed["n"].text() == "2/2 ExclusiveDeviceAllocateConflict"


def test_malformed_pair_scores_refuse_topology_aware_pods_only_and_are_reported() -> None:
    # TestGetNodeDevices_InvalidPairScores: HAMi registers no GPU of such a node.
    model = ClusterModel()
    problems = model.replace_nodes([pairs_node(scores="not-valid-json")])
    model.replace_pods([])
    (problem,) = problems
    assert (problem.kind, problem.name, problem.annotation) == ("Node", "n", keys.NODE_SCORE)
    topo = place(model, gpu_pod("t", container(gpu=2, gpumem=1000), annotations=TOPOLOGY))
    assert topo.node is None
    assert topo.unresolvable["n"].text() == "1/8 NodePairScoresMalformed"
    assert place(model, gpu_pod("s", container(gpu=2, gpumem=1000))).node == "n"


def test_pair_scores_are_read_from_the_node_and_follow_its_changes() -> None:
    # TestGetNodeDevices_PairScores.
    model = model_with(pairs_node())
    assert model.nodes[NodeName("n")].pair_scores["GPU-0"]["GPU-1"] == 1250
    changed = pairs_node(scores=encode_node_scores({"GPU-0": {"GPU-1": 100}, "GPU-1": {"GPU-0": 100}}))
    model.apply_node("MODIFIED", changed)
    assert model.nodes[NodeName("n")].pair_scores == {"GPU-0": {"GPU-1": 100}, "GPU-1": {"GPU-0": 100}}
