"""Every fit rule and policy, on the model fed with Node/Pod JSON (pure, no cluster)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from builders import container, gpu, gpu_node, gpu_pod

from hamipy.extender.filtering import build_ask, decide, summarize
from hamipy.extender.fitting import NodeReasons, fit_pod
from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.scoring import prioritize_score
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import DeviceInfo
from hamipy.protocol.pod_devices import encode_pod_devices

CONFIG = Config()
NOW = 1_000_000.0


def model_with(*nodes: dict[str, Any]) -> ClusterModel:
    model = ClusterModel()
    model.replace_nodes(nodes)
    model.replace_pods([])
    return model


def fit(model: ClusterModel, name: str, p: dict[str, Any]) -> Any:
    return fit_pod(model.nodes[NodeName(name)], build_ask(p, CONFIG))


def uuids(devices: Any) -> list[list[str]]:
    return [[d.uuid for d in slot] for slot in devices]


def texts(reasons: Mapping[NodeName, NodeReasons]) -> dict[str, str]:
    return {name: r.text() for name, r in reasons.items()}


# -- per-GPU rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "asking", "annotations", "reason"),
    [
        pytest.param(
            gpu("G", health=False), container(gpu=1, gpumem=10), {}, "CardNotHealth", id="unhealthy"
        ),
        pytest.param(
            gpu("G", mem=100), container(gpu=1, gpumem=200), {}, "CardInsufficientMemory", id="memory"
        ),
        pytest.param(
            gpu("G", count=0), container(gpu=1, gpumem=10), {}, "CardTimeSlicingExhausted", id="slots"
        ),
        pytest.param(
            gpu("G", core=50), container(gpu=1, gpucores=60), {}, "CardInsufficientCore", id="cores"
        ),
        pytest.param(
            gpu("G"),
            container(gpu=1, gpumem=10),
            {keys.USE_GPU_TYPE: "A100"},
            "CardTypeMismatch",
            id="use-type",
        ),
        pytest.param(
            gpu("G"),
            container(gpu=1, gpumem=10),
            {keys.NOUSE_GPU_TYPE: "v100"},
            "CardTypeMismatch",
            id="nouse-type",
        ),
        pytest.param(
            gpu("G"),
            container(gpu=1, gpumem=10),
            {keys.USE_GPU_UUID: "GPU-X"},
            "CardUuidMismatch",
            id="use-uuid",
        ),
        pytest.param(
            gpu("G"), container(gpu=1, gpumem=10), {keys.NOUSE_GPU_UUID: "G"}, "CardUuidMismatch", id="nouse"
        ),
        pytest.param(
            gpu("G"), container(gpu=1, gpumem=10), {keys.VGPU_MODE: "mig"}, "CardTypeMismatch", id="mode"
        ),
        pytest.param(gpu("G"), container(gpu=2, gpumem=10), {}, "NodeInsufficientDevice", id="too-many-gpus"),
    ],
)
def test_single_gpu_rule_refuses_with_hami_reason(
    device: DeviceInfo, asking: dict[str, Any], annotations: dict[str, str], reason: str
) -> None:
    model = model_with(gpu_node("n", [device]))
    result = fit(model, "n", gpu_pod("p", asking, annotations=annotations))
    assert not result.ok
    assert reason in result.why().text()


def test_cordoned_gpu_is_skipped() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0), gpu("B", 1)], annotations={keys.DEVICE_CORDON: "A"}))
    result = fit(model, "n", gpu_pod("p", container(gpu=2, gpumem=10)))
    assert not result.ok
    assert "1/2 CardCordoned" in result.why().text()
    assert "1/2 AllocatedCardsInsufficientRequest" in result.why().text()


def test_type_selector_picks_matching_gpu() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0, type_="NVIDIA-A100"), gpu("B", 1, type_="NVIDIA-T4")]))
    result = fit(model, "n", gpu_pod("p", container(gpu=1, gpumem=10), annotations={keys.USE_GPU_TYPE: "t4"}))
    assert uuids(result.devices) == [["B"]]


def test_uuid_selector_picks_named_gpu() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0), gpu("B", 1), gpu("C", 2)]))
    result = fit(model, "n", gpu_pod("p", container(gpu=1, gpumem=10), annotations={keys.USE_GPU_UUID: "C"}))
    assert uuids(result.devices) == [["C"]]


def allocated(name: str, node_name: str, value: str, **kw: Any) -> dict[str, Any]:
    return gpu_pod(
        name, node_name=node_name, annotations={keys.DEVICES_ALLOCATED: value}, phase="Running", **kw
    )


def test_exclusive_cores_refused_on_used_gpu_and_block_others() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0)]))
    model.apply_pod("ADDED", allocated("a", "n", "A,NVIDIA,100,0:;"))
    result = fit(model, "n", gpu_pod("p", container(gpu=1, gpumem=10, gpucores=100)))
    assert "ExclusiveDeviceAllocateConflict" in result.why().text()
    model2 = model_with(gpu_node("n", [gpu("A", 0)]))
    model2.apply_pod("ADDED", allocated("x", "n", "A,NVIDIA,100,100:;"))
    zero = fit(model2, "n", gpu_pod("p", container(gpu=1, gpumem=10)))
    assert "CardInsufficientCore" not in zero.why().text()
    assert "CardComputeUnitsExhausted" in zero.why().text()


def test_memory_percentage_is_resolved_per_gpu() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0, mem=10000)]))
    result = fit(model, "n", gpu_pod("p", container(gpu=1, gpumem_percentage=30)))
    assert result.devices[0][0].usedmem == 3000
    model.apply_pod("ADDED", allocated("a", "n", "A,NVIDIA,8000,0:;"))
    assert (
        "CardInsufficientMemory"
        in fit(model, "n", gpu_pod("p", container(gpu=1, gpumem_percentage=30))).why().text()
    )


def test_no_memory_asked_takes_whole_gpu() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0, mem=10000)]))
    result = fit(model, "n", gpu_pod("p", container(gpu=1)))
    assert result.devices[0][0].usedmem == 10000


def test_two_gpus_in_one_container_are_distinct() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0), gpu("B", 1), gpu("C", 2)]))
    result = fit(model, "n", gpu_pod("p", container(gpu=2, gpumem=100)))
    assert len(set(uuids(result.devices)[0])) == 2


def test_numa_bind_keeps_a_container_on_one_numa_node() -> None:
    devices = [gpu("A", 0, numa=0), gpu("B", 1, numa=1), gpu("C", 2, numa=1)]
    model = model_with(gpu_node("n", devices))
    bound = fit(model, "n", gpu_pod("p", container(gpu=2, gpumem=10), annotations={keys.NUMA_BIND: "true"}))
    assert sorted(uuids(bound.devices)[0]) == ["B", "C"]
    three = fit(model, "n", gpu_pod("p", container(gpu=3, gpumem=10), annotations={keys.NUMA_BIND: "true"}))
    assert "NumaNotFit" in three.why().text()


def test_containers_add_up_and_init_containers_count_by_peak() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0, mem=10000)]))
    two = gpu_pod("p", container("a", gpu=1, gpumem=6000), container("b", gpu=1, gpumem=6000))
    assert "CardInsufficientMemory" in fit(model, "n", two).why().text()
    with_init = gpu_pod(
        "p",
        container("a", gpu=1, gpumem=5000),
        container("b", gpu=1, gpumem=5000),
        init=[container("i", gpu=1, gpumem=9000), container("plain")],
    )
    result = fit(model, "n", with_init)
    assert [len(s) for s in result.devices] == [1, 0, 1, 1]
    # The allocation counts 10000 (apps) not 19000 (all).
    model.apply_pod(
        "ADDED",
        allocated(
            "q",
            "n",
            encode_pod_devices(result.devices),
            init=[container("i", gpu=1), container("plain")],
        ),
    )
    assert model.nodes[NodeName("n")].gpus[0].used_mem == 10000


def test_a_native_sidecar_is_fitted_as_running_beside_the_apps() -> None:
    # A 40000 MiB sidecar and a 40000 MiB app must not both go on one 60000 MiB GPU.
    sidecar = container("proxy", gpu=1, gpumem=40000, restartPolicy="Always")
    p = gpu_pod("p", container("app", gpu=1, gpumem=40000), init=[sidecar])
    one = model_with(gpu_node("n", [gpu("A", 0, mem=60000)]))
    assert fit(one, "n", p).why().text() == "1/1 CardInsufficientMemory"
    two = model_with(gpu_node("n", [gpu("A", 0, mem=60000), gpu("B", 1, mem=60000)]))
    placed = fit(two, "n", p)
    assert sorted(u for slot in uuids(placed.devices) for u in slot) == ["A", "B"]
    two.apply_pod("ADDED", allocated("q", "n", encode_pod_devices(placed.devices), init=[sidecar]))
    assert [g.used_mem for g in two.nodes[NodeName("n")].gpus] == [40000, 40000]
    # The same pod with a run-to-completion init container fits one GPU (they never run together).
    plain = gpu_pod(
        "p", container("app", gpu=1, gpumem=40000), init=[container("setup", gpu=1, gpumem=40000)]
    )
    assert uuids(fit(one, "n", plain).devices) == [["A"], ["A"]]


def test_an_init_container_after_a_sidecar_is_fitted_with_the_sidecar_taken() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0, mem=10000)]))
    init = [container("side", gpu=1, gpumem=4000, restartPolicy="Always"), container("i", gpu=1, gpumem=7000)]
    assert "CardInsufficientMemory" in fit(model, "n", gpu_pod("p", container(), init=init)).why().text()
    before = [init[1], init[0]]  # the init container runs before the sidecar starts: alone
    assert fit(model, "n", gpu_pod("p", container(), init=before)).ok


# -- policies ---------------------------------------------------------------------------------------


def test_gpu_policy_binpack_vs_spread() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0), gpu("B", 1)]))
    model.apply_pod("ADDED", allocated("a", "n", "B,NVIDIA,1000,0:;"))
    spread = gpu_pod("p", container(gpu=1, gpumem=100), annotations={keys.GPU_SCHEDULER_POLICY: "spread"})
    binpack = gpu_pod("p", container(gpu=1, gpumem=100), annotations={keys.GPU_SCHEDULER_POLICY: "binpack"})
    assert uuids(fit(model, "n", spread).devices) == [["A"]]
    assert uuids(fit(model, "n", binpack).devices) == [["B"]]


@pytest.mark.parametrize(("policy", "expected"), [("binpack", "busy"), ("spread", "idle")])
def test_node_policy_binpack_vs_spread(policy: str, expected: str) -> None:
    model = model_with(gpu_node("busy"), gpu_node("idle"))
    model.apply_pod("ADDED", allocated("a", "busy", "GPU-busy-0,NVIDIA,1000,10:;"))
    p = gpu_pod("p", container(gpu=1, gpumem=100), annotations={keys.NODE_SCHEDULER_POLICY: policy})
    decision = decide(model, build_ask(p, CONFIG), [NodeName("busy"), NodeName("idle")], now=NOW)
    assert decision.node == expected


def test_config_default_policies_apply_without_annotations() -> None:
    config = Config(node_scheduler_policy="spread", gpu_scheduler_policy=("binpack",))
    ask = build_ask(gpu_pod("p"), config)
    assert (ask.node_policy, ask.gpu_rule.keys) == ("spread", ("binpack", "numa"))


def test_prioritize_score_ranges() -> None:
    assert prioritize_score(0.0, "spread") == 10
    assert prioritize_score(0.0, "binpack") == 0
    assert prioritize_score(3.0, "binpack") == 10


# -- filter decisions and reasons --------------------------------------------------------------------


def test_reservation_is_seen_by_the_next_filter() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0, count=1)]))
    ask = build_ask(gpu_pod("p"), CONFIG)
    first = decide(model, ask, [NodeName("n")], now=NOW)
    assert first.node == "n"
    assert first.devices is not None
    model.reserve(
        uid=PodUid("u1"),
        namespace="ns",
        name="p",
        node=NodeName("n"),
        devices=first.devices,
        n_init=0,
        expires_at=5,
    )
    second = decide(model, ask, [NodeName("n")], now=NOW)
    assert second.node is None
    assert texts(second.failed) == {"n": "1/1 CardTimeSlicingExhausted"}
    assert model.expire(10) == 1
    assert decide(model, ask, [NodeName("n")], now=NOW).node == "n"


def test_reasons_counted_per_cause_and_unresolvable_nodes() -> None:
    model = model_with(gpu_node("small", [gpu("A", 0, mem=100)]), gpu_node("one", [gpu("B", 0)]))
    ask = build_ask(gpu_pod("p", container(gpu=2, gpumem=1000)), CONFIG)
    decision = decide(model, ask, [NodeName("small"), NodeName("one"), NodeName("ghost")], now=NOW)
    assert decision.node is None
    assert decision.unresolvable == {
        "small": NodeReasons((("NodeInsufficientDevice", 1),), 1),
        "one": NodeReasons((("NodeInsufficientDevice", 1),), 1),
        "ghost": NodeReasons.of_node("NodeUnregistered"),
    }
    summary = summarize(decision.failed, decision.unresolvable)
    assert summary.by_cause == (
        ("NodeInsufficientDevice", ("one", "small")),
        ("NodeUnregistered", ("ghost",)),
    )
    assert summary.top_cause() == "NodeInsufficientDevice"
    assert summary.text() == "2 nodes NodeInsufficientDevice(one,small); 1 nodes NodeUnregistered(ghost)"


def test_reasons_are_worded_once_as_hami_words_them() -> None:
    assert NodeReasons((("CardInsufficientMemory", 1), ("CardTimeSlicingExhausted", 7)), 8).text() == (
        "1/8 CardInsufficientMemory, 7/8 CardTimeSlicingExhausted"
    )
    assert NodeReasons.of_node("InvalidRequest", "bad gpumem").text() == "InvalidRequest: bad gpumem"
    assert summarize({}, {}).top_cause() == "NoNodes"
    assert summarize({}, {}).text() == ""
    many = {NodeName(f"n{i}"): NodeReasons.of_node("NodeUnregistered") for i in range(7)}
    assert summarize({}, many).text(limit=2) == "7 nodes NodeUnregistered(n0,n1,...)"


def test_cooperative_returns_every_feasible_node() -> None:
    model = model_with(gpu_node("a"), gpu_node("b"), gpu_node("c", [gpu("X", 0, mem=10)]))
    decision = decide(
        model,
        build_ask(gpu_pod("p"), CONFIG),
        [NodeName("a"), NodeName("b"), NodeName("c")],
        now=NOW,
        all_feasible=True,
    )
    assert sorted(n for n, _, _ in decision.feasible) == ["a", "b"]


# -- model safety -----------------------------------------------------------------------------------


def test_malformed_register_offers_nothing_and_is_reported() -> None:
    bad = gpu_node("n")
    bad["metadata"]["annotations"][keys.NODE_REGISTER] = "[{not json"
    model = ClusterModel()
    problems = model.replace_nodes([bad])
    assert problems
    assert problems[0].kind == "Node"
    decision = decide(model, build_ask(gpu_pod("p"), CONFIG), [NodeName("n")], now=NOW)
    assert texts(decision.unresolvable) == {"n": "NodeRegisterMalformed"}


def test_malformed_allocation_makes_its_node_unusable_until_the_pod_goes() -> None:
    model = model_with(gpu_node("n"))
    bad = allocated("bad", "n", "GPU-n-0,NVIDIA,-5,0:;")
    problems = model.apply_pod("ADDED", bad)
    assert problems
    assert problems[0].kind == "Pod"
    ask = build_ask(gpu_pod("p"), CONFIG)
    assert texts(decide(model, ask, [NodeName("n")], now=NOW).failed) == {"n": "NodeAllocationUnknown"}
    model.apply_pod("DELETED", bad)
    assert decide(model, ask, [NodeName("n")], now=NOW).node == "n"


def test_finished_and_deleted_pods_free_their_gpus() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0)]))
    running = allocated("a", "n", "A,NVIDIA,1000,10:;")
    model.apply_pod("ADDED", running)
    assert model.nodes[NodeName("n")].gpus[0].used_mem == 1000
    done = {**running, "status": {"phase": "Succeeded"}}
    model.apply_pod("MODIFIED", done)
    assert model.nodes[NodeName("n")].gpus[0].used_mem == 0


def test_register_change_keeps_usage_of_remaining_gpus() -> None:
    model = model_with(gpu_node("n", [gpu("A", 0), gpu("B", 1)]))
    model.apply_pod("ADDED", allocated("a", "n", "A,NVIDIA,1000,10:;"))
    model.apply_node("MODIFIED", gpu_node("n", [gpu("A", 0, mem=2000), gpu("C", 1)]))
    state = model.nodes[NodeName("n")]
    assert [(g.uuid, g.used_mem) for g in state.gpus] == [("A", 1000), ("C", 0)]


def test_dead_node_by_handshake_rule() -> None:
    n = gpu_node("n", annotations={keys.NODE_HANDSHAKE: "Requesting_1970-01-01 00:00:00"})
    n["status"]["allocatable"][keys.RESOURCE_COUNT] = "0"
    model = model_with(n)
    decision = decide(model, build_ask(gpu_pod("p"), CONFIG), [NodeName("n")], now=NOW)
    assert texts(decision.failed) == {"n": "NodeHandshakeTimeout"}


def test_pod_without_gpu_ask_and_malformed_ask() -> None:
    assert not build_ask(gpu_pod("p", container()), CONFIG).requests.any
    with pytest.raises(ValueError, match="gpumem"):
        build_ask(gpu_pod("p", container(gpu=1, gpumem="0.5")), CONFIG)
