"""The node order the model keeps for filters (``hamipy.extender.node_order``): its own rules, and
that the model keeps it equal to its nodes sorted by score through every kind of change."""

from __future__ import annotations

from builders import allocation, container, gpu, gpu_node, gpu_pod, running_pod
from hypothesis import given, settings
from hypothesis import strategies as st

from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.node_order import NodeOrder
from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice


def test_spread_is_emptiest_first_and_binpack_fullest_first_ties_by_name_in_both() -> None:
    order = NodeOrder()
    for name, score in (("c", 0.5), ("a", 0.5), ("b", 0.0), ("d", 1.0)):
        order.put(NodeName(name), score)
    assert list(order.names(binpack=False)) == ["b", "a", "c", "d"]
    assert list(order.names(binpack=True)) == ["d", "a", "c", "b"]


def test_put_moves_a_node_whose_score_changed_and_drop_forgets_it() -> None:
    order = NodeOrder()
    order.put(NodeName("a"), 0.1)
    order.put(NodeName("b"), 0.2)
    order.put(NodeName("a"), 0.3)
    order.put(NodeName("a"), 0.3)  # unchanged: stays once
    assert list(order.names(binpack=False)) == ["b", "a"]
    assert (order.score(NodeName("a")), len(order)) == (0.3, 2)
    order.drop(NodeName("b"))
    order.drop(NodeName("ghost"))  # not there: nothing
    assert list(order.names(binpack=True)) == ["a"]
    assert (order.score(NodeName("b")), len(order)) == (None, 1)


NODES = [f"n{i}" for i in range(4)]
SLOT = st.integers(min_value=0, max_value=5)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("node"), st.sampled_from(NODES), st.integers(min_value=1, max_value=3)),
        st.tuples(st.just("delete-node"), st.sampled_from(NODES), st.just(0)),
        st.tuples(st.just("pod"), st.sampled_from(NODES), SLOT),
        st.tuples(st.just("delete-pod"), st.sampled_from(NODES), SLOT),
        st.tuples(st.just("reserve"), st.sampled_from(NODES), SLOT),
        st.tuples(st.just("release"), st.sampled_from(NODES), SLOT),
        st.tuples(st.just("bad-pod"), st.sampled_from([*NODES, "elsewhere"]), SLOT),
        st.tuples(st.just("relist"), st.sampled_from(NODES), st.integers(min_value=1, max_value=3)),
    ),
    max_size=30,
)


def apply(model: ClusterModel, op: str, name: str, n: int) -> None:
    match op:
        case "node" | "relist":
            # n GPUs: re-registering with another count changes the node's score
            state = gpu_node(name, [gpu(f"GPU-{name}-{i}", i, mem=1000 * (i + 1)) for i in range(n)])
            if op == "node":
                model.apply_node("ADDED", state)
            else:  # a full list of only this node: the others are forgotten
                model.replace_nodes([state])
        case "delete-node":
            model.apply_node("DELETED", gpu_node(name))
        case "pod":
            model.apply_pod(
                "MODIFIED",
                running_pod(f"p{n}", allocated=f"GPU-{name}-0,NVIDIA,{100 * (n + 1)},{5 * n}:;", node=name),
            )
        case "delete-pod":
            model.apply_pod(
                "DELETED", running_pod(f"p{n}", allocated=f"GPU-{name}-0,NVIDIA,0,0:;", node=name)
            )
        case "reserve":
            uid = PodUid(f"r{n}")
            devices = [[ContainerDevice(f"GPU-{name}-0", keys.DEVICE_VENDOR_NVIDIA, 50 * (n + 1), n)]]
            model.reserve(
                uid=uid,
                namespace="ns",
                name=f"r{n}",
                node=NodeName(name),
                devices=devices,
                n_init=0,
                expires_at=1e12,
            )
        case "release":
            model.release(PodUid(f"r{n}"))
        case "bad-pod":  # a malformed allocation: on an unknown node, the model makes a placeholder node
            malformed = allocation(allocated="x")
            bad = gpu_pod(f"b{n}", container(gpu=1), node_name=name, phase="Running", annotations=malformed)
            model.apply_pod("MODIFIED", bad)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_the_model_keeps_the_order_equal_to_its_nodes_sorted_by_score(
    ops: list[tuple[str, str, int]],
) -> None:
    model = ClusterModel()
    model.replace_nodes([gpu_node(name) for name in NODES[:2]])
    for op in ops:
        apply(model, *op)
        scores = {name: state.score for name, state in model.nodes.items()}
        assert {name: model.order.score(name) for name in scores} == scores
        assert len(model.order) == len(model.nodes)
        assert list(model.order.names(binpack=False)) == sorted(scores, key=lambda n: (scores[n], n))
        assert list(model.order.names(binpack=True)) == sorted(scores, key=lambda n: (-scores[n], n))
