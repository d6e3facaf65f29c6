"""The decision over many nodes (``hamipy.extender.filtering``, pure): which nodes the summary check
skips, which node is chosen, and how a failure is explained per node and across nodes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import builders
import pytest
from builders import allocation, container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, bind_rig, filter_args
from hypothesis import given, settings
from hypothesis import strategies as st

from hamipy.extender import filtering
from hamipy.extender.filtering import build_ask, decide, summarize
from hamipy.extender.fitting import NodeReasons, PodAsk, fit_pod
from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.scoring import node_rank_key
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import ContainerDevice, DeviceInfo
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_handshake import requesting

CONFIG = Config()
NOW = 1_000_000.0
T4 = "NVIDIA-Tesla T4"
A100 = "NVIDIA-A100-SXM4-80GB"


def dev(uuid: str, mem: int, cores: int = 0) -> ContainerDevice:
    return ContainerDevice(uuid, keys.DEVICE_VENDOR_NVIDIA, mem, cores)


def holding(name: str, node_name: str, *devices: ContainerDevice) -> dict[str, Any]:
    """A running pod on ``node_name`` whose one container holds ``devices``."""
    return gpu_pod(
        name, node_name=node_name, phase="Running", annotations=allocation(allocated=[list(devices)])
    )


def model_of(*nodes: dict[str, Any], pods: tuple[dict[str, Any], ...] = ()) -> ClusterModel:
    model = ClusterModel()
    model.replace_nodes(nodes)
    model.replace_pods(pods)
    return model


def ask_of(*containers: dict[str, Any], **annotations: str) -> PodAsk:
    """The ask of a pod of ``containers`` (one asking a GPU and 100 MiB when none) and annotations
    given by key (``ask_of(**{keys.USE_GPU_TYPE: "A100"})``)."""
    return build_ask(
        gpu_pod("p", *(containers or [container(gpu=1, gpumem=100)]), annotations=annotations), CONFIG
    )


def typed_node(name: str, type_: str) -> dict[str, Any]:
    return gpu_node(name, [gpu(f"{name}-0", 0, type_=type_), gpu(f"{name}-1", 1, type_=type_)])


def texts(reasons: dict[NodeName, NodeReasons]) -> dict[str, str]:
    return {name: r.text() for name, r in reasons.items()}


# -- the summary check skips nodes, and only those ----------------------------------------------------


@pytest.mark.parametrize(
    "skipped",
    [
        pytest.param("ghost", id="unknown-node"),
        pytest.param("plain", id="unregistered-node"),
        pytest.param("full", id="no-free-slot"),
        pytest.param("small", id="too-little-memory"),
    ],
)
def test_a_skipped_node_does_not_hide_the_nodes_after_it(skipped: str) -> None:
    model = model_of(
        builders.node("plain"),
        gpu_node("full", [gpu("F", 0, count=1)]),
        gpu_node("small", [gpu("S", 0, mem=50)]),
        gpu_node("fits"),
        pods=(holding("x", "full", dev("F", 10)),),
    )
    decision = decide(model, ask_of(), [NodeName(skipped), NodeName("fits")], now=NOW)
    assert (decision.node, decision.fitted) == ("fits", 1)


def test_summary_check_skips_without_fitting() -> None:
    model = model_of(
        gpu_node("one-gpu", [gpu("O", 0)]),
        gpu_node("small", [gpu("S0", 0, mem=500), gpu("S1", 1, mem=500)]),
        gpu_node("full", [gpu("F", 0, count=1), gpu("G", 1, count=1)]),
        pods=(holding("x", "full", dev("F", 10), dev("G", 10)),),
    )
    decision = decide(
        model,
        ask_of(container(gpu=2, gpumem=600)),
        [NodeName("one-gpu"), NodeName("small"), NodeName("full")],
        now=NOW,
    )
    assert decision.node is None
    assert decision.fitted == 0
    assert texts(decision.failed) == {"full": "2/2 CardTimeSlicingExhausted"}
    assert texts(decision.unresolvable) == {
        "one-gpu": "1/1 NodeInsufficientDevice",
        "small": "2/2 CardInsufficientMemory",
    }


def test_memory_equal_to_the_free_memory_is_placed() -> None:
    # A whole-GPU ask: exactly what is left, on the only GPU.
    model = model_of(gpu_node("n", [gpu("A", 0, mem=1000)]), pods=(holding("x", "n", dev("A", 400)),))
    decision = decide(model, ask_of(container(gpu=1, gpumem=600)), [NodeName("n")], now=NOW)
    assert decision.node == "n"
    assert decide(model, ask_of(container(gpu=1, gpumem=601)), [NodeName("n")], now=NOW).node is None


def test_cores_equal_to_the_free_cores_are_placed() -> None:
    model = model_of(gpu_node("n", [gpu("A", 0)]), pods=(holding("x", "n", dev("A", 100, 80)),))
    decision = decide(model, ask_of(container(gpu=1, gpumem=100, gpucores=20)), [NodeName("n")], now=NOW)
    assert (decision.node, decision.fitted) == ("n", 1)
    refused = decide(model, ask_of(container(gpu=1, gpumem=100, gpucores=21)), [NodeName("n")], now=NOW)
    assert (refused.node, refused.fitted) == (None, 0)


def handshaking(name: str, age_s: float) -> dict[str, Any]:
    """A node whose device plugin has not yet answered a ``Requesting_`` stamp ``age_s`` old (its
    allocatable GPU count is 0, as while a plugin restarts)."""
    stamp = requesting(datetime.fromtimestamp(NOW - age_s, UTC))
    return builders.node(
        name,
        [gpu(f"{name}-0", 0)],
        annotations={keys.NODE_HANDSHAKE: stamp},
        allocatable={keys.RESOURCE_COUNT: "0"},
    )


def test_nodes_mid_handshake_are_placed_on() -> None:
    model = model_of(handshaking("a", 0), handshaking("b", 59))
    decision = decide(model, ask_of(), [NodeName("a"), NodeName("b")], now=NOW)
    assert decision.node in {"a", "b"}
    cooperative = decide(model, ask_of(), [NodeName("a"), NodeName("b")], now=NOW, all_feasible=True)
    assert sorted(name for name, _, _ in cooperative.feasible) == ["a", "b"]


def test_nodes_whose_handshake_timed_out_are_skipped_and_explained() -> None:
    model = model_of(handshaking("dead", 60), gpu_node("alive"))
    decision = decide(model, ask_of(), [NodeName("dead")], now=NOW)
    assert (decision.node, decision.fitted) == (None, 0)
    assert texts(decision.failed) == {"dead": "NodeHandshakeTimeout"}
    assert decide(model, ask_of(), [NodeName("dead"), NodeName("alive")], now=NOW).node == "alive"


# -- type selectors, through the decision ---------------------------------------------------------------


@pytest.mark.parametrize("policy", ["binpack", "spread"])
@pytest.mark.parametrize(
    ("selector", "chosen"),
    [
        pytest.param({keys.USE_GPU_TYPE: "a100"}, "a100", id="use-gputype"),
        pytest.param({keys.NOUSE_GPU_TYPE: "T4"}, "a100", id="nouse-gputype"),
        pytest.param({keys.USE_GPU_TYPE: "tesla"}, "t4", id="use-gputype-substring"),
        pytest.param({keys.USE_GPU_TYPE: "NVIDIA", keys.NOUSE_GPU_TYPE: "a100"}, "t4", id="use-and-nouse"),
    ],
)
def test_type_selector_chooses_among_nodes_whatever_the_ranking(
    policy: str, selector: dict[str, str], chosen: str
) -> None:
    # Two T4 nodes ranked on both sides of the A100 node: neither policy reaches the right type first.
    model = model_of(
        typed_node("t4-busy", T4),
        typed_node("a100", A100),
        typed_node("t4", T4),
        pods=(holding("x", "t4-busy", dev("t4-busy-0", 20000, 50)), holding("y", "a100", dev("a100-0", 100))),
    )
    ask = ask_of(**selector, **{keys.NODE_SCHEDULER_POLICY: policy})
    decision = decide(model, ask, [NodeName("t4-busy"), NodeName("a100"), NodeName("t4")], now=NOW)
    # Among the T4 nodes the policy still ranks: binpack the busy one, spread the idle one.
    expected = {"t4": {"binpack": "t4-busy", "spread": "t4"}}.get(chosen, {}).get(policy, chosen)
    assert (decision.node, decision.fitted) == (expected, 1)


def test_type_no_node_has_is_skipped_unfitted_and_explained() -> None:
    model = model_of(typed_node("t4-a", T4), typed_node("t4-b", T4), typed_node("a100", A100))
    for selector in ({keys.USE_GPU_TYPE: "H100"}, {keys.NOUSE_GPU_TYPE: "NVIDIA"}):
        decision = decide(
            model, ask_of(**selector), [NodeName("t4-a"), NodeName("t4-b"), NodeName("a100")], now=NOW
        )
        assert (decision.node, decision.fitted) == (None, 0)
        assert texts(decision.unresolvable) == dict.fromkeys(["t4-a", "t4-b", "a100"], "2/2 CardTypeMismatch")


def test_node_with_any_accepted_gpu_type_is_fitted() -> None:
    mixed = gpu_node("mixed", [gpu("T", 0, type_=T4), gpu("A", 1, type_=A100)])
    decision = decide(model_of(mixed), ask_of(**{keys.USE_GPU_TYPE: "A100"}), [NodeName("mixed")], now=NOW)
    assert decision.devices is not None
    assert [[d.uuid for d in slot] for slot in decision.devices] == [["A"]]


# -- ranking ---------------------------------------------------------------------------------------------


NODE_USAGE = st.lists(
    st.tuples(st.integers(min_value=0, max_value=31000), st.integers(min_value=0, max_value=100)),
    min_size=2,
    max_size=5,
)


@settings(max_examples=150, deadline=None)
@given(
    NODE_USAGE,
    st.sampled_from(["binpack", "spread"]),
    st.integers(min_value=1, max_value=20000),
    st.integers(min_value=0, max_value=60),
    st.booleans(),
    st.integers(min_value=0, max_value=100),
)
def test_decide_law_the_best_ranked_node_that_fits_wins(
    usage: list[tuple[int, int]], policy: str, memory: int, unsent: int, twice: bool, cores: int
) -> None:
    """Among the names sent (twice each with ``twice``), whatever the nodes not sent (idle ones,
    which spread would rank first): with few sent, decide ranks the names; with many, it walks the
    model's order."""
    names = [NodeName(f"n{i}") for i in range(len(usage))]
    model = model_of(
        *(gpu_node(name) for name in names),
        *(gpu_node(f"idle{i}") for i in range(unsent)),
        pods=tuple(
            holding(f"x{i}", name, dev(f"GPU-{name}-0", mem, cores))
            for i, (name, (mem, cores)) in enumerate(zip(names, usage, strict=True))
        ),
    )
    ask = ask_of(container(gpu=2, gpumem=memory, gpucores=cores), **{keys.NODE_SCHEDULER_POLICY: policy})
    fitting = [n for n in names if fit_pod(model.nodes[n], ask).ok]
    decision = decide(model, ask, names * 2 if twice else names, now=NOW)
    if not fitting:
        assert decision.node is None
        return
    best = min(fitting, key=lambda n: (node_rank_key(model.nodes[n].score, ask.node_policy), n))
    assert decision.node == best


def test_fitted_counts_the_nodes_fitted_until_one_fits() -> None:
    model = model_of(
        gpu_node("busy"),
        gpu_node("idle"),
        pods=(holding("x", "busy", dev("GPU-busy-0", 100, 90)),),
    )
    # binpack tries the busy node first: its summary passes (GPU 1 has every core left), but the pod
    # wants 20 cores on each of two GPUs and GPU 0 has 10.
    ask = ask_of(container(gpu=2, gpumem=100, gpucores=20), **{keys.NODE_SCHEDULER_POLICY: "binpack"})
    decision = decide(model, ask, [NodeName("busy"), NodeName("idle")], now=NOW)
    assert (decision.node, decision.fitted) == ("idle", 2)
    assert (decision.failed, decision.unresolvable) == ({}, {})
    first = decide(model, ask_of(), [NodeName("busy"), NodeName("idle")], now=NOW)
    assert (first.node, first.fitted) == ("busy", 1)


def test_a_node_without_the_cores_asked_left_on_any_gpu_is_skipped_unfitted_and_explained() -> None:
    model = model_of(
        gpu_node("busy"),
        gpu_node("idle"),
        pods=(holding("x", "busy", dev("GPU-busy-0", 100, 90), dev("GPU-busy-1", 100, 90)),),
    )
    # Slots and memory left on both GPUs, 10 cores on each: binpack would try it first.
    ask = ask_of(container(gpu=1, gpumem=100, gpucores=20), **{keys.NODE_SCHEDULER_POLICY: "binpack"})
    decision = decide(model, ask, [NodeName("busy"), NodeName("idle")], now=NOW)
    assert (decision.node, decision.fitted) == ("idle", 1)
    alone = decide(model, ask, [NodeName("busy")], now=NOW)
    assert (alone.node, alone.fitted) == (None, 0)
    assert texts(alone.failed) == {"busy": "2/2 CardInsufficientCore"}
    assert model.nodes[NodeName("busy")].max_free_cores == 10


# -- cooperative mode -------------------------------------------------------------------------------------


def test_cooperative_fits_every_candidate_and_returns_those_that_fit_with_scores() -> None:
    model = model_of(
        gpu_node("a"),
        gpu_node("b"),
        gpu_node("small", [gpu("S", 0, mem=10)]),
        pods=(holding("x", "b", dev("GPU-b-0", 1000, 10)),),
    )
    decision = decide(
        model,
        ask_of(),
        [NodeName("a"), NodeName("b"), NodeName("small"), NodeName("ghost")],
        now=NOW,
        all_feasible=True,
    )
    assert [(name, score) for name, _, score in sorted(decision.feasible)] == [
        ("a", 0.0),
        ("b", model.nodes[NodeName("b")].score),
    ]
    assert model.nodes[NodeName("b")].score > 0
    assert decision.fitted == 2  # small and ghost are skipped by the summary check
    assert decision.node is None


def test_cooperative_with_nothing_feasible_explains_every_node() -> None:
    model = model_of(gpu_node("a", [gpu("A", 0, count=1)]), gpu_node("small", [gpu("S", 0, mem=10)]))
    model.apply_pod("ADDED", holding("x", "a", dev("A", 10)))
    decision = decide(
        model, ask_of(), [NodeName("a"), NodeName("small"), NodeName("ghost")], now=NOW, all_feasible=True
    )
    assert decision.feasible == []
    assert texts(decision.failed) == {"a": "1/1 CardTimeSlicingExhausted"}
    assert texts(decision.unresolvable) == {
        "small": "1/1 CardInsufficientMemory",
        "ghost": "NodeUnregistered",
    }


# -- failed (not now) against unresolvable (never) ---------------------------------------------------------


@pytest.mark.parametrize("order", [["a", "b"], ["b", "a"]], ids=["named-node-first", "named-node-last"])
def test_uuid_selector_tells_alike_nodes_apart_when_explained(order: list[str]) -> None:
    # Two nodes of one shape; the pod names a GPU of a, whose slot is taken now.
    model = model_of(
        gpu_node("a", [gpu("GPU-a", 0, count=1)]),
        gpu_node("b", [gpu("GPU-b", 0, count=1)]),
        pods=(holding("x", "a", dev("GPU-a", 10)),),
    )
    decision = decide(model, ask_of(**{keys.USE_GPU_UUID: "GPU-a"}), map(NodeName, order), now=NOW)
    assert texts(decision.failed) == {"a": "1/1 CardTimeSlicingExhausted"}
    assert texts(decision.unresolvable) == {"b": "1/1 CardUuidMismatch"}


@pytest.mark.parametrize(
    ("devices", "failed"),
    [
        pytest.param([gpu("A", 0, count=1, mem=1000)], True, id="full-now-failed"),
        pytest.param([gpu("A", 0, count=1, mem=100)], False, id="too-small-unresolvable"),
    ],
)
def test_node_that_could_fit_once_freed_is_failed_not_unresolvable(
    devices: list[DeviceInfo], failed: bool
) -> None:
    model = model_of(gpu_node("n", devices), pods=(holding("x", "n", dev("A", 10)),))
    decision = decide(model, ask_of(container(gpu=1, gpumem=500)), [NodeName("n")], now=NOW)
    assert ("n" in decision.failed, "n" in decision.unresolvable) == (failed, not failed)


def test_malformed_nodes_are_explained_by_what_is_wrong() -> None:
    bad_register = gpu_node("bad-register")
    bad_register["metadata"]["annotations"][keys.NODE_REGISTER] = "[{not json"
    model = model_of(bad_register, gpu_node("bad-pod"), builders.node("plain"))
    malformed = allocation(allocated="GPU-bad-pod-0,NVIDIA,-5,0:;")
    model.apply_pod("ADDED", gpu_pod("x", node_name="bad-pod", phase="Running", annotations=malformed))
    names = [NodeName(n) for n in ("bad-register", "bad-pod", "plain", "ghost")]
    decision = decide(model, ask_of(), names, now=NOW)
    assert (decision.node, decision.fitted) == (None, 0)
    assert texts(decision.failed) == {"bad-pod": "NodeAllocationUnknown"}
    assert texts(decision.unresolvable) == {
        "bad-register": "NodeRegisterMalformed",
        "plain": "NodeUnregistered",
        "ghost": "NodeUnregistered",
    }


# -- the pod's policies ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("annotation", "configured", "keys_"),
    [
        pytest.param("binpack,spread", ("spread",), ("binpack", "spread"), id="the-pods-chain"),
        pytest.param("spread", ("binpack",), ("spread", "numa"), id="annotation-over-config"),
        pytest.param("spread", ("numa",), ("spread", "numa"), id="annotation-over-a-numa-config"),
        pytest.param(None, ("binpack",), ("binpack", "numa"), id="config-default"),
        pytest.param(None, ("numa", "spread"), ("numa", "spread"), id="config-chain"),
    ],
)
def test_gpu_policy_is_the_pods_chain_else_the_configured_one(
    annotation: str | None, configured: tuple[str, ...], keys_: tuple[str, ...]
) -> None:
    annotations = {keys.GPU_SCHEDULER_POLICY: annotation} if annotation else {}
    config = Config.model_validate({"gpu_scheduler_policy": ",".join(configured)})
    assert build_ask(gpu_pod("p", annotations=annotations), config).gpu_rule.keys == keys_


def test_the_filter_places_a_topology_aware_pod() -> None:
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0), gpu("B", 1)]))
    p = gpu_pod("p", container(gpu=2, gpumem=10), annotations={keys.GPU_SCHEDULER_POLICY: "topology-aware"})
    r.add_watched_pod(p)
    result = r.scheduler.filter(filter_args(p, ["n"]))
    assert result["NodeNames"] == ["n"]


# -- across nodes ----------------------------------------------------------------------------------------


def test_failure_summary_ranks_causes_by_nodes_then_name() -> None:
    failed = {
        NodeName("n1"): NodeReasons.of_node("NodeUnregistered"),
        NodeName("n2"): NodeReasons.of_node("NodeUnregistered"),
        NodeName("n3"): NodeReasons((("CardInsufficientMemory", 1),), 1),
        NodeName("n0"): NodeReasons((("ZCause", 1),), 1),
        NodeName("n9"): NodeReasons((("ACause", 1),), 1),
    }
    summary = summarize(failed, {})
    # The longest cause name fails fewest nodes; ties go by cause, not by the nodes it names.
    assert [cause for cause, _ in summary.by_cause] == [
        "NodeUnregistered",
        "ACause",
        "CardInsufficientMemory",
        "ZCause",
    ]
    assert summary.top_cause() == "NodeUnregistered"


@pytest.mark.parametrize(
    ("n_nodes", "shown"),
    [
        pytest.param(4, "n0,n1,n2,n3", id="fewer-than-five"),
        pytest.param(5, "n0,n1,n2,n3,n4", id="five-all-shown"),
        pytest.param(6, "n0,n1,n2,n3,n4,...", id="six-five-shown"),
    ],
)
def test_failure_summary_names_five_nodes_per_cause(n_nodes: int, shown: str) -> None:
    unresolvable = {NodeName(f"n{i}"): NodeReasons.of_node("NodeUnregistered") for i in range(n_nodes)}
    assert summarize({}, unresolvable).text() == f"{n_nodes} nodes NodeUnregistered({shown})"


def asked_mib(ask: PodAsk) -> int | None:
    [request] = ask.requests.containers
    assert request is not None
    return request.memory_mib


def test_a_watched_pods_ask_is_built_once_per_version_of_the_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    real = filtering.build_ask

    def counting(p: Any, config: Config) -> PodAsk:
        built.append(p["metadata"]["name"])
        return real(p, config)

    monkeypatch.setattr(filtering, "build_ask", counting)
    model = model_of(pods=(gpu_pod("p", container(gpu=1, gpumem=300)),))
    first = model.pending[PodUid("uid-ns-p")]
    ask = filtering.ask_of(first, CONFIG)
    assert asked_mib(ask) == 300
    assert filtering.ask_of(first, CONFIG) is ask  # its filters and its bind read the same asks
    assert built == ["p"]
    assert filtering.ask_of(first, Config()) is not ask  # under another configuration: its own asks
    assert built == ["p", "p"]
    model.apply_pod("MODIFIED", gpu_pod("p", container(gpu=1, gpumem=500)))  # the pod changed
    again = filtering.ask_of(model.pending[PodUid("uid-ns-p")], CONFIG)
    assert asked_mib(again) == 500
    assert built == ["p", "p", "p"]


def test_a_malformed_watched_pod_is_refused_every_time() -> None:
    model = model_of(pods=(gpu_pod("bad", container(gpu=1, gpumem="0.5")),))
    pending = model.pending[PodUid("uid-ns-bad")]
    for _ in range(2):
        with pytest.raises(ProtocolError, match="is not a whole number"):
            filtering.ask_of(pending, CONFIG)
