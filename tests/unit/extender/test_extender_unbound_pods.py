"""A pod that is not bound holds nothing (the block attack): anyone who may create pods can
write ``hami.io/vgpu-node`` and ``vgpu-devices-allocated`` on their own pending pod, so only a bound
pod's allocation, or a bind of this extender in flight, takes capacity; in the model, in the bind's
fresh re-check and in the invariant checker alike."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from builders import allocation, container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_args, bind_rig, filter_args, shared_rig

from hamipy.extender.invariant import check_cluster, check_objects
from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.kube.errors import KubeError
from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice

# Two GPUs, each one slot: a claim on both makes the node look full.
GPUS = [gpu("A", 0, count=1, mem=1000, core=100), gpu("B", 1, count=1, mem=1000, core=100)]
EVERYTHING = [[ContainerDevice("A", "NVIDIA", 1000, 100), ContainerDevice("B", "NVIDIA", 1000, 100)]]


def squatter(*, bound: bool = False, allocated: Any = EVERYTHING, labelled: bool = True) -> dict[str, Any]:
    """Another tenant's pod asking no GPU, annotated (and labelled) as holding every GPU of node n."""
    p = gpu_pod(
        "squat",
        container(),
        namespace="tenant",
        node_name="n" if bound else None,
        scheduler_name="default-scheduler",
        annotations=allocation(allocated=allocated, node="n", phase="allocating"),
    )
    if labelled:
        p["metadata"]["labels"] = {keys.VGPU_NODE_LABEL: "n"}
    return p


def rig() -> BindRig:
    return bind_rig(BIND_SETTINGS, gpu_node("n", GPUS))


def used(model: ClusterModel) -> dict[str, tuple[int, int, int]]:
    return {g.uuid: (g.used_slots, g.used_mem, g.used_cores) for g in model.nodes[NodeName("n")].gpus}


def filter_n(r: BindRig, p: dict[str, Any]) -> list[str]:
    names: list[str] = r.scheduler.filter(filter_args(p, ["n"]))["NodeNames"]
    return names


# -- the model ----------------------------------------------------------------------------------------


def test_a_pending_pod_claiming_every_gpu_takes_nothing_and_the_node_still_places_pods() -> None:
    r = rig()
    assert r.model.apply_pod("ADDED", squatter()) == []
    assert r.model.contributions == {}
    assert used(r.model) == {"A": (0, 0, 0), "B": (0, 0, 0)}
    r.add_watched_pod(gpu_pod("p"))
    assert filter_n(r, gpu_pod("p")) == ["n"]


def test_a_malformed_allocation_on_a_pending_pod_is_reported_but_blocks_nothing() -> None:
    r = rig()
    [problem] = r.model.apply_pod("ADDED", squatter(allocated="not a device list"))
    assert (problem.kind, problem.namespace, problem.name) == ("Pod", "tenant", "squat")
    assert problem.field.startswith(keys.DEVICES_ALLOCATED)
    assert not r.model.nodes[NodeName("n")].bad_pods
    r.add_watched_pod(gpu_pod("p"))
    assert filter_n(r, gpu_pod("p")) == ["n"]


def test_a_bound_pods_allocation_counts() -> None:
    r = rig()
    r.model.apply_pod("ADDED", squatter(bound=True))
    assert used(r.model) == {"A": (1, 1000, 100), "B": (1, 1000, 100)}
    r.add_watched_pod(gpu_pod("p"))
    assert filter_n(r, gpu_pod("p")) == []


def test_a_malformed_allocation_on_a_bound_pod_blocks_its_node_until_it_goes() -> None:
    r = rig()
    bad = squatter(bound=True, allocated="not a device list")
    assert len(r.model.apply_pod("ADDED", bad)) == 1
    r.add_watched_pod(gpu_pod("p"))
    answer = r.scheduler.filter(filter_args(gpu_pod("p"), ["n"]))
    assert answer["NodeNames"] == []
    assert answer["FailedNodes"] == {"n": "NodeAllocationUnknown"}
    r.model.apply_pod("DELETED", bad)
    assert filter_n(r, gpu_pod("p")) == ["n"]


def test_a_pending_pods_binding_makes_its_allocation_count() -> None:
    r = rig()
    r.model.apply_pod("ADDED", squatter())
    r.model.apply_pod("MODIFIED", squatter(bound=True))
    assert r.model.contributions[PodUid("uid-tenant-squat")].source == "allocated"
    assert used(r.model)["A"] == (1, 1000, 100)
    assert PodUid("uid-tenant-squat") not in r.model.pending


# -- our own bind in flight ---------------------------------------------------------------------------


async def test_our_bind_in_flight_counts_across_its_watch_events_until_bound() -> None:
    r = rig()
    p = gpu_pod("p", container(gpu=1, gpumem=1000, gpucores=100))
    r.add_watched_pod(p)
    other = gpu_pod("q", container(gpu=2, gpumem=1000))
    r.add_watched_pod(other)
    seen: list[tuple[str, tuple[int, int, int], list[str]]] = []

    def watch_mid_bind(method: str, path: str, body: Any) -> None:
        if (method, path) == ("POST", "/api/v1/namespaces/ns/pods/p/binding"):
            # The watch delivers the pod as patched (annotated, not bound yet), and, late, as it
            # was before the patch: neither drops what the bind recorded.
            annotated = copy.deepcopy(r.kube.pod("ns", "p"))
            assert not annotated["spec"].get("nodeName")
            r.model.apply_pod("MODIFIED", annotated)
            r.model.apply_pod("MODIFIED", p)
            held = r.model.contributions[PodUid("uid-ns-p")]
            gpu_used = next(iter(held.usage.values()))
            seen.append((held.source, gpu_used, filter_n(r, other)))

    r.kube.on_request = watch_mid_bind
    assert (await r.scheduler.bind(bind_args(p)))["Error"] == ""
    # Mid-bind it held its GPU: a pod wanting both GPUs did not fit.
    assert seen == [("binding", (1, 1000, 100), [])]
    assert r.model.contributions[PodUid("uid-ns-p")].source == "allocated"
    generation = r.model.generation
    # The Binding's watch event (same annotation, now bound) changes nothing.
    assert r.model.apply_pod("MODIFIED", copy.deepcopy(r.kube.pod("ns", "p"))) == []
    assert r.model.generation == generation
    # A stale event from before the Binding, delivered late, does not drop the allocation either.
    stale = copy.deepcopy(r.kube.pod("ns", "p"))
    stale["spec"].pop("nodeName")
    r.model.apply_pod("MODIFIED", stale)
    assert r.model.contributions[PodUid("uid-ns-p")].source == "allocated"


async def test_a_failed_bind_drops_its_in_flight_record() -> None:
    r = rig()
    p = gpu_pod("p")
    r.add_watched_pod(p)

    def fail_binding(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/binding"):
            assert r.model.contributions[PodUid("uid-ns-p")].source == "binding"
            raise KubeError("boom", status=403)

    r.kube.on_request = fail_binding
    assert "boom" in (await r.scheduler.bind(bind_args(p)))["Error"]
    assert r.model.contributions == {}
    assert used(r.model) == {"A": (0, 0, 0), "B": (0, 0, 0)}


# -- the bind's fresh re-check and the invariant --------------------------------------------------------


async def test_the_bind_re_check_ignores_a_pending_pod_labelled_and_annotated_for_the_node() -> None:
    r = rig()
    r.kube.add(squatter())
    r.add_watched_pod(gpu_pod("p", container(gpu=2, gpumem=1000)))
    assert (await r.scheduler.bind(bind_args(gpu_pod("p"))))["Error"] == ""
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert (await check_cluster(r.kube)).ok


async def test_binds_queued_in_one_lock_session_count_each_other() -> None:
    # One slot per GPU, three pods: the session's fresh state must count what it just bound.
    r = shared_rig(BIND_SETTINGS, gpu_node("n", GPUS))
    pods = [gpu_pod(f"p{i}") for i in range(3)]
    for p in pods:
        r.add_watched_pod(p)
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    errors = sorted(res["Error"] for res in results)
    assert errors[:2] == ["", ""]
    assert "no longer fits node n" in errors[2]
    assert (await check_cluster(r.kube)).ok


def test_the_invariant_counts_bound_pods_only() -> None:
    registered = gpu_node("n", GPUS)
    over = [squatter(), squatter(bound=True)]
    over[1]["metadata"]["name"] = "bound"
    assert check_objects([registered], over).ok
    assert check_objects([registered], [squatter(allocated="garbage")]).ok
    twice = copy.deepcopy(over[1])
    twice["metadata"]["name"] = "twice"
    report = check_objects([registered], [over[1], twice])
    assert not report.ok
    assert report.pods == 2
