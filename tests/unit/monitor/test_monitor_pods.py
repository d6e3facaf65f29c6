"""A pod is reduced to its names and each container's allocated slice; a bad annotation is an error
on the record, never a guess."""

from __future__ import annotations

from builders import running_pod
from monitor_fakes import GPU_A, GPU_B, slice_

from hamipy.monitor.pods import pod_record
from hamipy.protocol import keys


def test_slots_map_to_init_containers_first_then_regular_ones() -> None:
    record = pod_record(
        running_pod(
            "multi",
            init=["setup"],
            containers=["sidecar", "app", "pair"],
            allocated=[[slice_(mem=500)], [], [slice_(mem=2000)], [slice_(GPU_A, 1000), slice_(GPU_B, 1000)]],
        )
    )
    assert record.containers == ("setup", "sidecar", "app", "pair")
    assert {name: [(d.uuid, d.usedmem) for d in devs] for name, devs in record.allocations.items()} == {
        "setup": [(GPU_A, 500)],
        "app": [(GPU_A, 2000)],
        "pair": [(GPU_A, 1000), (GPU_B, 1000)],
    }
    assert record.allocation_error is None
    assert (record.uid, record.namespace, record.name, record.phase) == (
        "uid-ns-multi",
        "ns",
        "multi",
        "Running",
    )


def test_older_hami_lists_with_regular_containers_only_are_read() -> None:
    record = pod_record(running_pod("old", init=["setup"], containers=["app"], allocated=[[slice_(mem=700)]]))
    assert list(record.allocations) == ["app"]


def test_a_slot_count_that_does_not_match_the_pod_is_an_error() -> None:
    record = pod_record(running_pod("odd", containers=["a", "b", "c"], allocated=[[slice_()], [slice_()]]))
    assert record.allocations == {}
    assert record.allocation_error is not None
    assert record.allocation_error.field == keys.DEVICES_ALLOCATED
    assert "2 container slots for 0 init and 3 regular containers" in str(record.allocation_error)


def test_a_malformed_annotation_is_an_error_naming_the_field() -> None:
    record = pod_record(running_pod("bad", allocated="GPU-A,NVIDIA,-5,0:;"))
    assert record.allocations == {}
    assert record.allocation_error is not None
    assert record.allocation_error.field == f"{keys.DEVICES_ALLOCATED}[0][0].usedmem"


def test_a_pod_without_allocation_has_no_slices_and_no_error() -> None:
    record = pod_record(running_pod("plain"))
    assert (record.allocations, record.allocation_error, record.annotation) == ({}, None, None)


def test_terminated_containers_and_finished_pods_are_recognised() -> None:
    record = pod_record(running_pod("done", containers=["a", "b"], terminated=["b"], phase="Succeeded"))
    assert record.terminated == frozenset({"b"})
    assert record.terminal
    assert not pod_record(running_pod("running")).terminal


def test_a_list_without_the_empty_slot_of_an_init_container_belongs_to_the_gpu_container() -> None:
    raw = running_pod("p", init=["setup"], containers=["main"], allocated="GPU-A,NVIDIA,1000,0:;")
    raw["spec"]["containers"][0]["resources"] = {"limits": {keys.RESOURCE_COUNT: "1"}}
    record = pod_record(raw)
    assert record.allocation_error is None
    assert {name: [d.uuid for d in devices] for name, devices in record.allocations.items()} == {
        "main": ["GPU-A"]
    }
