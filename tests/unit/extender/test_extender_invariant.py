"""The invariant checked against the API's objects: no GPU holds more slots, memory or cores than it
registers, and an unreadable annotation is a violation rather than a pass."""

from __future__ import annotations

import builders
from builders import gpu, gpu_node, gpu_pod
from fake_kube import FakeKube

from hamipy.extender.invariant import check_cluster, check_objects
from hamipy.protocol import keys


def running(name: str, allocated: str) -> dict[str, object]:
    return gpu_pod(name, node_name="n", annotations={keys.DEVICES_ALLOCATED: allocated}, phase="Running")


async def test_overcommit_is_reported_per_gpu_and_dimension() -> None:
    kube = FakeKube()
    kube.add(gpu_node("n", [gpu("A", 0, count=1, mem=1000)]))
    for name in ("a", "b"):
        kube.add(running(name, "A,NVIDIA,600,0:;"))
    report = await check_cluster(kube)
    assert {v.what for v in report.violations} == {"slots", "memory"}
    assert not report.ok


async def test_a_cluster_within_capacity_passes_and_finished_pods_do_not_count() -> None:
    kube = FakeKube()
    kube.add(gpu_node("n", [gpu("A", 0, count=1, mem=1000)]))
    kube.add(running("a", "A,NVIDIA,600,0:;"))
    kube.add(
        gpu_pod(
            "done", node_name="n", annotations={keys.DEVICES_ALLOCATED: "A,NVIDIA,600,0:;"}, phase="Succeeded"
        )
    )
    report = await check_cluster(kube)
    assert report.ok
    assert (report.nodes, report.gpus, report.pods) == (1, 1, 1)


def test_an_unreadable_allocation_is_a_violation() -> None:
    report = check_objects([gpu_node("n")], [running("a", "not a device list")])
    assert not report.ok
    assert "unreadable allocation of ns/a" in str(report.violations[0])


def test_a_native_sidecar_counts_as_running_beside_the_app() -> None:
    def bound(*, sidecar: bool) -> dict[str, object]:
        policy = {"restartPolicy": "Always"} if sidecar else {}
        init = [{**builders.container("proxy", gpu=1, gpumem=400), **policy}]
        both = {keys.DEVICES_ALLOCATED: "A,NVIDIA,400,0:;A,NVIDIA,400,0:;"}
        return gpu_pod("p", node_name="n", annotations=both, phase="Running", init=init)

    gpus = [gpu_node("n", [gpu("A", 0, count=2, mem=600)])]
    report = check_objects(gpus, [bound(sidecar=True)])
    assert [(v.what, v.allocated, v.capacity) for v in report.violations] == [("memory", 800, 600)]
    # A run-to-completion init container counts by its peak against the app, not with it.
    assert check_objects(gpus, [bound(sidecar=False)]).ok


def test_mig_instances_sharing_slices_of_a_gpu_are_a_violation() -> None:
    def mig(name: str, start: int, size: int) -> dict[str, object]:
        held = (
            f'[{{"containerIndex":0,"deviceIndex":0,"gpuUUID":"A","profile":"{size}g.x",'
            f'"placement":{{"start":{start},"size":{size}}}}}]'
        )
        both = {keys.DEVICES_ALLOCATED: "A,NVIDIA,1,0:;", keys.MIG_ALLOCATIONS: held}
        return gpu_pod(name, node_name="n", annotations=both, phase="Running")

    gpus = [gpu_node("n", [gpu("A", 0, count=7, mem=40960)])]
    assert check_objects(gpus, [mig("a", 0, 4), mig("b", 4, 2), mig("c", 6, 1)]).ok
    (violation,) = check_objects(gpus, [mig("a", 0, 4), mig("b", 2, 2)]).violations
    assert str(violation) == "n/A: MIG instances at slices 0 and 2 overlap (pods ns/a, ns/b)"
