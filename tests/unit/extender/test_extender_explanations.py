"""Explanations of nodes a pod does not fit, reused for the same ask while the node is unchanged
(``hamipy.extender.explanations``): reused, and never stale."""

from __future__ import annotations

from typing import Any

import pytest
from builders import allocation, container, gpu, gpu_node, gpu_pod

from hamipy.extender import filtering, fitting
from hamipy.extender.explanations import Explained, Explanations
from hamipy.extender.filtering import build_ask, decide
from hamipy.extender.fitting import PodAsk
from hamipy.extender.model import ClusterModel, NodeState
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.identifiers import NodeName

NOW = 1_000_000.0


def holding(name: str, node_name: str, uuid: str, mem: int) -> dict[str, Any]:
    devices = [[ContainerDevice(uuid, keys.DEVICE_VENDOR_NVIDIA, mem, 0)]]
    return gpu_pod(name, node_name=node_name, phase="Running", annotations=allocation(allocated=devices))


def ask(mem: int) -> PodAsk:
    return build_ask(gpu_pod("p", container(gpu=1, gpumem=mem)), Config())


def cluster() -> ClusterModel:
    # Two nodes of one GPU (2 slots, 1000 MiB), 950 MiB taken on each.
    model = ClusterModel()
    model.replace_nodes([gpu_node(n, [gpu(f"GPU-{n}", 0, count=2, mem=1000)]) for n in ("a", "b")])
    model.replace_pods([holding(f"x-{n}", n, f"GPU-{n}", 950) for n in ("a", "b")])
    return model


@pytest.fixture
def fits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The nodes fitted, in order (``fit_pod`` counted where ``filtering`` calls it)."""
    fitted: list[str] = []
    real = fitting.fit_pod

    def counting(state: Any, *args: Any, **kwargs: Any) -> Any:
        fitted.append(state.name)
        return real(state, *args, **kwargs)

    monkeypatch.setattr(filtering, "fit_pod", counting)
    return fitted


def texts(model: ClusterModel, explained: Explanations, mem: int = 100) -> dict[str, str]:
    decision = decide(model, ask(mem), [NodeName("a"), NodeName("b")], now=NOW, explained=explained)
    assert decision.node is None
    return {name: r.text() for name, r in (decision.failed | decision.unresolvable).items()}


def test_unchanged_nodes_are_not_fitted_again_for_the_same_ask(fits: list[str]) -> None:
    model, explained = cluster(), Explanations()
    first = texts(model, explained)
    assert first == {"a": "1/1 CardInsufficientMemory", "b": "1/1 CardInsufficientMemory"}
    fitted = len(fits)
    assert texts(model, explained) == first
    assert len(fits) == fitted  # nothing fitted the second time
    texts(model, explained, mem=200)  # another ask: its own explanations
    assert len(fits) > fitted


def test_a_node_whose_usage_changed_is_explained_anew(fits: list[str]) -> None:
    model, explained = cluster(), Explanations()
    texts(model, explained)
    fits.clear()
    model.apply_pod("ADDED", holding("y", "a", "GPU-a", 10))  # a's second slot taken as well
    assert texts(model, explained) == {
        "a": "1/1 CardTimeSlicingExhausted",
        "b": "1/1 CardInsufficientMemory",
    }
    assert set(fits) == {"a"}  # its fit, and its fit as if empty


def test_a_node_registered_anew_is_explained_anew(fits: list[str]) -> None:
    model, explained = ClusterModel(), Explanations()
    model.replace_nodes([gpu_node("b", [gpu("GPU-b", 0, count=2, mem=500)])])
    model.replace_pods([])
    first = decide(model, ask(600), [NodeName("b")], now=NOW, explained=explained)
    assert {n: r.text() for n, r in first.unresolvable.items()} == {"b": "1/1 CardInsufficientMemory"}
    fits.clear()
    # Registered anew, its GPU now unhealthy: a new node state, at the same version as the old one.
    model.apply_node("MODIFIED", gpu_node("b", [gpu("GPU-b", 0, count=2, mem=500, health=False)]))
    again = decide(model, ask(600), [NodeName("b")], now=NOW, explained=explained)
    assert {n: r.text() for n, r in again.unresolvable.items()} == {"b": "1/1 CardNotHealth"}
    assert "b" in fits


def test_it_keeps_the_last_asks_only_and_forgets_nodes_gone() -> None:
    explained = Explanations(max_asks=2)
    asks = [ask(100), ask(200), ask(300)]
    entry = Explained(NodeState(name=NodeName("n")), 0, None, True)
    for a in asks:
        explained.of(a, nodes=2)["n"] = entry
    assert len(explained) == 2
    assert explained.of(asks[0], nodes=2) == {}  # the oldest was dropped
    known = explained.of(asks[2], nodes=2)
    assert known == {"n": entry}  # still kept
    known.update(dict.fromkeys(("m", "o", "p", "q"), entry))
    assert explained.of(asks[2], nodes=2) == {}  # more than twice the nodes there are: started over
