"""The model's edges that mutation testing showed no test pinned: a node with no readable allocatable
count, empty and malformed allocations, what a pending pod keeps, the change counter, a node that
goes before its pods, and what ``apply_pod`` returns."""

from __future__ import annotations

import io
import time
from datetime import UTC, datetime
from typing import Any

import builders
import pytest
from builders import allocation, gpu, gpu_pod

from hamipy.extender.model import ClusterModel, NodeName, PodUid, now_epoch
from hamipy.extender.telemetry import Telemetry
from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.node_handshake import requesting

NOW = 1_000_000.0
TWO_GPUS = [gpu("A", 0, count=10, mem=1000, core=100), gpu("B", 1, count=10, mem=1000, core=100)]


def model_with(*nodes: dict[str, object]) -> ClusterModel:
    model = ClusterModel()
    model.replace_nodes(nodes)
    model.replace_pods([])
    return model


@pytest.mark.parametrize("allocatable", [{}, {keys.RESOURCE_COUNT: "lots"}], ids=["absent", "unparsable"])
def test_no_readable_allocatable_count_counts_as_none_for_liveness(allocatable: dict[str, str]) -> None:
    stamp = requesting(datetime.fromtimestamp(NOW - 3600, UTC))
    n = builders.node("n", TWO_GPUS, annotations={keys.NODE_HANDSHAKE: stamp}, allocatable=allocatable)
    state = model_with(n).nodes[NodeName("n")]
    assert state.allocatable_gpus == 0
    assert state.dead(NOW)


def test_a_bound_pod_with_an_empty_allocation_holds_nothing_and_blocks_nothing() -> None:
    model = model_with(builders.node("n", TWO_GPUS))
    problems = model.apply_pod("ADDED", gpu_pod("p", node_name="n", annotations={keys.DEVICES_ALLOCATED: ""}))
    assert problems == []
    assert not model.contributions
    assert model.nodes[NodeName("n")].usable(NOW)


def test_a_pending_pod_keeps_its_identity_preferences_and_asks_only() -> None:
    model = model_with(builders.node("n", TWO_GPUS))
    p = gpu_pod("p", annotations={keys.USE_GPU_TYPE: "A100"})
    p["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    p["status"] = {"phase": "Pending", "conditions": []}
    assert model.apply_pod("ADDED", p) == []
    kept = model.pending[PodUid("uid-ns-p")]
    assert kept.pod["metadata"] == {
        "name": "p",
        "namespace": "ns",
        "uid": "uid-ns-p",
        "resourceVersion": "1",
        "annotations": {keys.USE_GPU_TYPE: "A100"},
    }
    assert set(kept.pod["spec"]) == {"schedulerName", "containers"}
    assert (kept.namespace, kept.name, kept.scheduler_name) == ("ns", "p", "hami-scheduler")


def test_every_change_moves_the_generation_forward() -> None:
    model = ClusterModel()
    seen = [model.generation]
    model.apply_node("ADDED", builders.node("n", TWO_GPUS))
    seen.append(model.generation)
    devices = [[ContainerDevice("A", keys.DEVICE_VENDOR_NVIDIA, 100, 10)]]
    model.apply_pod("ADDED", gpu_pod("p", node_name="n", annotations=allocation(allocated=devices)))
    seen.append(model.generation)
    model.apply_pod("DELETED", gpu_pod("p", node_name="n"))
    seen.append(model.generation)
    assert seen == sorted(set(seen)), seen


def test_held_counts_each_pod_once_under_its_current_source_and_the_gauge_reads_it() -> None:
    model = model_with(builders.node("n", TWO_GPUS))
    telemetry = Telemetry.create(stream=io.StringIO())
    telemetry.metrics.attach(model)
    devices = [[ContainerDevice("A", keys.DEVICE_VENDOR_NVIDIA, 100, 10)]]
    raw = allocation(allocated=devices)[keys.DEVICES_ALLOCATED]
    who: dict[str, Any] = {"uid": PodUid("uid-ns-p"), "namespace": "ns", "name": "p", "node": NodeName("n")}
    steps = []
    model.reserve(**who, devices=devices, n_init=0, expires_at=NOW)
    steps.append(dict(model.held))
    model.begin_bind(**who, devices=devices, n_init=0, raw=raw)
    steps.append(dict(model.held))
    model.allocate(**who, devices=devices, n_init=0, raw=raw)
    model.reserve(**{**who, "uid": PodUid("q")}, devices=devices, n_init=0, expires_at=NOW)
    steps.append(dict(model.held))

    def gauge(source: str) -> float | None:
        return telemetry.metrics.registry.get_sample_value("hamipy_extender_pods_held", {"source": source})

    assert [gauge(s) for s in ("allocated", "reserved", "binding")] == [1.0, 1.0, 0.0]
    assert model.expire(NOW) == 1
    model.apply_pod("DELETED", gpu_pod("p", node_name="n"))
    steps.append(dict(model.held))
    assert steps == [
        {"allocated": 0, "binding": 0, "reserved": 1},
        {"allocated": 0, "binding": 1, "reserved": 0},
        {"allocated": 1, "binding": 0, "reserved": 1},
        {"allocated": 0, "binding": 0, "reserved": 0},
    ]
    assert gauge("allocated") == 0.0


def test_a_node_deleted_before_its_malformed_pod_is_whole_when_it_returns() -> None:
    model = model_with(builders.node("n", TWO_GPUS))
    bad = gpu_pod("bad", node_name="n", annotations={keys.DEVICES_ALLOCATED: "not,a,slot"})
    assert model.apply_pod("ADDED", bad)  # reported
    assert not model.nodes[NodeName("n")].usable(NOW)
    model.apply_node("DELETED", builders.node("n", TWO_GPUS))
    assert model.apply_pod("DELETED", bad) == []
    model.apply_node("ADDED", builders.node("n", TWO_GPUS))
    assert model.nodes[NodeName("n")].usable(NOW)


def test_apply_pod_always_answers_a_list_of_problems() -> None:
    model = model_with(builders.node("n", TWO_GPUS))
    devices = [[ContainerDevice("A", keys.DEVICE_VENDOR_NVIDIA, 100, 10)]]
    placed = gpu_pod("p", node_name="n", annotations=allocation(allocated=devices))
    assert model.apply_pod("ADDED", placed) == []
    # Its annotations removed (a failed bind cleaned up), then finished, then an unbound pod.
    assert model.apply_pod("MODIFIED", gpu_pod("p", node_name="n")) == []
    assert model.apply_pod("MODIFIED", gpu_pod("p", node_name="n", phase="Succeeded")) == []
    assert model.apply_pod("ADDED", gpu_pod("q")) == []
    (problem,) = model.apply_pod("ADDED", gpu_pod("r", annotations={keys.DEVICES_ALLOCATED: "garbage"}))
    assert problem.name == "r"
    assert problem.field.startswith(keys.DEVICES_ALLOCATED)
    # A list with all of those kinds of pods in it.
    listed = [
        placed,
        gpu_pod("s", phase="Failed"),
        gpu_pod("q"),
        gpu_pod("r", annotations={keys.DEVICES_ALLOCATED: "garbage"}),
    ]
    assert [p.name for p in model.replace_pods(listed)] == ["r"]


def test_now_epoch_is_the_wall_clock() -> None:
    assert abs(now_epoch() - time.time()) < 5
