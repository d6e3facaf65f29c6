"""``/filter`` reserves only for pods that exist: a pod the pod watch has seen pending for
our scheduler, with the asks the watch has for it. A made-up call (an unknown UID, a pod of another
scheduler, a bound pod's UID, an inflated copy of a real pod) is answered but reserves nothing more
than the real pod asks and frees nothing that is held."""

from __future__ import annotations

import copy
from typing import Any

from builders import allocation, container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_args, bind_rig, filter_args

from hamipy.extender.model import NodeName, PodUid
from hamipy.extender.scheduler import UNKNOWN_POD
from hamipy.kube.errors import KubeError

# Two nodes of one GPU split 2 ways: four one-GPU reservations would fill them.
NODES = ["n", "m"]


def rig() -> BindRig:
    return bind_rig(BIND_SETTINGS, *(gpu_node(name, [gpu(f"GPU-{name}", 0, count=2)]) for name in NODES))


def filter_all(r: BindRig, p: dict[str, Any]) -> list[str]:
    names: list[str] = r.scheduler.filter(filter_args(p, NODES))["NodeNames"]
    return names


def decisions(r: BindRig, reason: str) -> float:
    value = r.telemetry.metrics.registry.get_sample_value(
        "hamipy_extender_decisions_total", {"verb": "filter", "result": "fit", "reason": reason}
    )
    return value or 0.0


def test_made_up_filters_are_answered_but_reserve_nothing() -> None:
    r = rig()
    for i in range(8):
        made_up = gpu_pod(f"ghost{i}", namespace="tenant")
        assert filter_all(r, made_up) != []
    assert r.model.contributions == {}
    assert decisions(r, UNKNOWN_POD) == 8
    assert decisions(r, "Fit") == 0


def test_a_watched_pending_pod_of_ours_is_reserved() -> None:
    r = rig()
    p = gpu_pod("p")
    r.add_watched_pod(p)
    [chosen] = filter_all(r, p)
    held = r.model.contributions[PodUid("uid-ns-p")]
    assert (held.source, held.node, held.namespace, held.name) == ("reserved", chosen, "ns", "p")
    assert decisions(r, "Fit") == 1
    # Filtered again (a retry): the new decision replaces the old one, never adds to it.
    filter_all(r, p)
    assert [c.uid for c in r.model.contributions.values()] == ["uid-ns-p"]


def test_a_pod_filtered_before_the_watch_delivered_it_is_reserved_once_it_did() -> None:
    r = rig()
    p = gpu_pod("p")
    r.kube.add(p)
    assert filter_all(r, p) != []
    assert r.model.contributions == {}
    r.model.apply_pod("ADDED", p)
    filter_all(r, p)
    assert r.model.contributions[PodUid("uid-ns-p")].source == "reserved"


def test_a_pending_pod_of_another_scheduler_is_not_reserved() -> None:
    r = rig()
    p = gpu_pod("p", scheduler_name="default-scheduler")
    r.add_watched_pod(p)
    assert filter_all(r, p) != []
    assert r.model.contributions == {}


def test_a_pod_gone_or_bound_is_no_longer_reserved_for() -> None:
    r = rig()
    gone, bound = gpu_pod("gone"), gpu_pod("bound")
    r.add_watched_pod(gone)
    r.add_watched_pod(bound)
    r.model.apply_pod("DELETED", gone)
    r.model.apply_pod("MODIFIED", gpu_pod("bound", node_name="n", phase="Running"))
    filter_all(r, gone)
    filter_all(r, bound)
    assert r.model.contributions == {}
    assert r.model.pending == {}


def test_a_relist_forgets_pending_pods_not_listed() -> None:
    r = rig()
    r.add_watched_pod(gpu_pod("old"))
    r.model.replace_pods([gpu_pod("new")])
    assert set(r.model.pending) == {PodUid("uid-ns-new")}


def test_an_inflated_copy_of_a_real_pod_reserves_what_the_real_pod_asks() -> None:
    r = rig()
    real = gpu_pod("p", container(gpu=1, gpumem=1000))
    r.add_watched_pod(real)
    inflated = copy.deepcopy(real)
    inflated["spec"]["containers"] = [container(gpu=1, gpumem=30000, gpucores=100)]
    [chosen] = filter_all(r, inflated)
    [[device]] = r.model.contributions[PodUid("uid-ns-p")].devices
    assert (device.uuid, device.usedmem, device.usedcores) == (f"GPU-{chosen}", 1000, 0)
    # Renamed into another namespace, it is still reserved under the real pod's name.
    moved = copy.deepcopy(real)
    moved["metadata"].update(namespace="tenant", name="decoy")
    filter_all(r, moved)
    held = r.model.contributions[PodUid("uid-ns-p")]
    assert (held.namespace, held.name) == ("ns", "p")


def test_a_made_up_filter_of_a_bound_pods_uid_frees_nothing() -> None:
    r = rig()
    holder = gpu_pod(
        "holder",
        node_name="n",
        phase="Running",
        annotations=allocation(allocated="GPU-n,NVIDIA,1000,0:;GPU-n,NVIDIA,1000,0:;"),
    )
    r.model.apply_pod("ADDED", holder)
    unbound_copy = copy.deepcopy(holder)
    del unbound_copy["spec"]["nodeName"]
    filter_all(r, unbound_copy)
    assert r.model.contributions[PodUid("uid-ns-holder")].source == "allocated"
    assert r.model.nodes[NodeName("n")].gpus[0].used_slots == 2


async def test_a_filter_during_our_bind_leaves_the_bind_in_flight_alone() -> None:
    r = rig()
    p = gpu_pod("p")
    r.add_watched_pod(p)
    seen: list[str] = []

    def filter_mid_bind(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/binding"):
            filter_all(r, p)
            seen.append(r.model.contributions[PodUid("uid-ns-p")].source)

    r.kube.on_request = filter_mid_bind
    assert (await r.scheduler.bind(bind_args(p, "n")))["Error"] == ""
    assert seen == ["binding"]
    assert r.model.contributions[PodUid("uid-ns-p")].source == "allocated"


async def test_a_failed_bind_of_a_reserved_pod_frees_its_reservation() -> None:
    r = rig()
    p = gpu_pod("p")
    r.add_watched_pod(p)
    [chosen] = filter_all(r, p)
    r.kube.fail(KubeError("boom", status=403), "POST", "/api/v1/namespaces/ns/pods/p/binding")
    assert (await r.scheduler.bind(bind_args(p, chosen)))["Error"]
    assert r.model.contributions == {}
