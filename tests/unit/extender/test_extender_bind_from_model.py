"""Binds on a node our device plugin serves, by the replica that alone writes allocations, decide
from the model and make one write, the Binding carrying the allocation: no read of the pod or the
node, no node lock. Elsewhere (HAMi's plugin reported last, another replica may write, someone else
holds the node's lock) the locked path runs."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from builders import REPORT, allocation, container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_rig, filter_args

from hamipy.extender.errors import BindRefused
from hamipy.extender.invariant import check_cluster
from hamipy.extender.model import ClusterModel, PodUid
from hamipy.kube.resources import pod_path
from hamipy.protocol import decode_pod_devices, keys
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.identifiers import NodeName

NOW = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)


def rig(*nodes: dict[str, Any]) -> BindRig:
    return bind_rig(
        BIND_SETTINGS, *(nodes or (gpu_node("n", [gpu("A", 0, count=2)], ours=True),)), wall_clock=lambda: NOW
    )


def requests(r: BindRig) -> list[tuple[str, str]]:
    """Every request the binds made, the last path segment kept for bindings."""
    return list(r.kube.calls)


def bound_uuids(r: BindRig, name: str) -> list[str]:
    stored = r.kube.pod("ns", name)
    (slot,) = decode_pod_devices(stored["metadata"]["annotations"][keys.DEVICES_ALLOCATED])
    return [d.uuid for d in slot]


def path_count(r: BindRig, path: str) -> float:
    value = r.telemetry.metrics.registry.get_sample_value("hamipy_extender_bind_paths_total", {"path": path})
    return value or 0.0


async def test_a_watched_pod_is_bound_with_one_binding_and_nothing_else() -> None:
    r = rig()
    r.add_watched_pod(gpu_pod("p"))
    r.scheduler.filter(filter_args(gpu_pod("p"), ["n"]))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    # No hami.io/vgpu-node label patch: only HAMi's components read it, and they do not serve n.
    assert requests(r) == [("POST", "/api/v1/namespaces/ns/pods/p/binding")]
    stored = r.kube.pod("ns", "p")
    assert stored["spec"]["nodeName"] == "n"
    assert stored["metadata"]["annotations"][keys.BIND_PHASE] == "allocating"
    assert keys.VGPU_NODE_LABEL not in (stored["metadata"].get("labels") or {})
    assert bound_uuids(r, "p") == ["A"]
    held = r.model.contributions[PodUid("uid-ns-p")]
    assert (held.source, held.node) == ("allocated", "n")
    assert r.lock() is None
    assert path_count(r, "model") == 1
    assert path_count(r, "locked") == 0


async def test_a_pod_the_watch_has_not_delivered_is_read_once() -> None:
    r = rig()
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert [c[0] for c in requests(r)] == ["GET", "POST"]
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"


async def test_concurrent_binds_count_each_other_in_flight() -> None:
    """Two pods onto the last slot: the second decides while the first's Binding is in flight and is
    refused; nothing is over-full."""
    r = rig(gpu_node("n", [gpu("A", 0, count=1)], ours=True))
    for name in ("p", "q"):
        r.add_watched_pod(gpu_pod(name))
    arrived, release = asyncio.Event(), asyncio.Event()

    async def hold(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/p/binding"):
            arrived.set()
            await release.wait()

    r.kube.on_request = hold
    first = asyncio.create_task(
        r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    )
    await asyncio.wait_for(arrived.wait(), 5)
    with pytest.raises(BindRefused, match=r"no longer fits node n: .*CardTimeSlicingExhausted"):
        await r.binder.bind(namespace="ns", name="q", uid=PodUid("uid-ns-q"), node=NodeName("n"))
    release.set()
    await first
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert "nodeName" not in r.kube.pod("ns", "q")["spec"]
    assert set(r.model.contributions) == {PodUid("uid-ns-p")}
    report = await check_cluster(r.kube)
    assert report.ok, report.violations


async def test_a_stale_watched_version_is_read_again_and_written() -> None:
    """The watch has not delivered the pod's last change: the Binding is a Conflict, the pod is read
    and written again with its version, once."""
    r = rig()
    r.add_watched_pod(gpu_pod("p"))
    r.kube.write(pod_path("ns", "p"), {"metadata": {"labels": {"team": "a"}}})
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert [c[0] for c in requests(r)] == ["POST", "GET", "POST"]
    assert bound_uuids(r, "p") == ["A"]


@pytest.mark.parametrize("where", ["n", "m"])
async def test_a_pod_bound_by_another_bind_is_left_as_it_is(where: str) -> None:
    """The watch still shows the pod pending, but another bind of it (an earlier leader) bound it:
    on ``n`` (the node asked) the bind succeeds writing nothing, on ``m`` it is refused; either way
    the model takes what the pod really holds."""
    r = rig(
        gpu_node("n", [gpu("A", 0, count=2)], ours=True), gpu_node("m", [gpu("B", 0, count=2)], ours=True)
    )
    r.add_watched_pod(gpu_pod("p"))
    twin = {
        keys.VGPU_NODE: where,
        keys.DEVICES_ALLOCATED: f"{'A' if where == 'n' else 'B'},NVIDIA,1000,0:;",
        keys.BIND_PHASE: "allocating",
    }
    r.kube.write(pod_path("ns", "p"), {"metadata": {"annotations": twin}, "spec": {"nodeName": where}})
    if where == "n":
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    else:
        with pytest.raises(BindRefused, match="was bound to m by another bind meanwhile"):
            await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert [c[0] for c in requests(r)] == ["POST", "GET"]
    assert (
        r.kube.pod("ns", "p")["metadata"]["annotations"][keys.DEVICES_ALLOCATED]
        == twin[keys.DEVICES_ALLOCATED]
    )
    held = r.model.contributions[PodUid("uid-ns-p")]
    assert (held.node, held.raw) == (where, twin[keys.DEVICES_ALLOCATED])


def ours(model: ClusterModel, name: str) -> bool:
    return model.nodes[NodeName(name)].ours


def test_the_node_is_ours_while_our_marker_matches_its_last_report() -> None:
    model = ClusterModel()
    registered = gpu_node("n", [gpu("A", 0)], ours=True)
    model.apply_node("ADDED", registered)
    assert ours(model, "n")
    # The extender's Requesting_ stamp: still ours (the plugin answers it).
    requesting = {
        **registered,
        "metadata": {**registered["metadata"], "annotations": {**registered["metadata"]["annotations"]}},
    }
    requesting["metadata"]["annotations"][keys.NODE_HANDSHAKE] = "Requesting_2026-11-24 10:00:30"
    model.apply_node("MODIFIED", requesting)
    assert ours(model, "n")
    # HAMi's plugin reports (and re-registers): it leaves our marker behind, which no longer matches.
    hamis = gpu_node(
        "n",
        [gpu("A", 0, count=5)],
        annotations={
            keys.NODE_HANDSHAKE: "Reported_2026-11-24 10:01:00",
            keys.DEVICE_PLUGIN_MARKER: REPORT[keys.NODE_HANDSHAKE],
        },
    )
    model.apply_node("MODIFIED", hamis)
    assert not ours(model, "n")
    model.apply_node("ADDED", gpu_node("x", [gpu("X", 0)]))
    assert not ours(model, "x")  # no marker: HAMi's plugin or an older one of ours


@pytest.mark.parametrize("why", ["hamis-plugin", "not-exclusive", "locked-by-another"])
async def test_elsewhere_the_locked_path_runs(why: str) -> None:
    n = (
        gpu_node("n", [gpu("A", 0, count=2)])
        if why == "hamis-plugin"
        else gpu_node("n", [gpu("A", 0, count=2)], ours=True)
    )
    r = rig(n)
    r.add_watched_pod(gpu_pod("p"))
    if why == "not-exclusive":
        r.binder.exclusive = lambda: False
    if why == "locked-by-another":
        # Another scheduler's lock, 2 s old, whose owner was served: the locked path breaks it.
        r.add_watched_pod(gpu_pod("owner", annotations={keys.BIND_PHASE: "success"}))
        r.locked_by("ns", "owner", NOW - timedelta(seconds=2))
        r.model.apply_node("MODIFIED", r.kube.node("n"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert path_count(r, "locked") == 1
    assert path_count(r, "model") == 0
    assert any(method == "PATCH" and "/nodes/n" in path for method, path in requests(r)), "the lock was taken"


async def test_an_expired_lock_does_not_stop_the_model_path() -> None:
    r = rig()
    r.locked_by("ns", "gone", NOW - timedelta(minutes=6))
    r.model.apply_node("MODIFIED", r.kube.node("n"))
    r.add_watched_pod(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert path_count(r, "model") == 1


# -- what a bind or a filter again reports freed (requeue nudges) -------------------------------------


def reported_freed(r: BindRig) -> list[str | None]:
    """The model's ``on_freed`` calls from now on (what wakes the pods the filter refused)."""
    calls: list[str | None] = []
    r.model.on_freed = calls.append
    return calls


async def test_a_bind_onto_its_reserved_gpus_reports_nothing_freed() -> None:
    r = rig()
    r.add_watched_pod(gpu_pod("p"))
    r.scheduler.filter(filter_args(gpu_pod("p"), ["n"]))
    freed = reported_freed(r)
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert freed == []


async def test_a_bind_elsewhere_than_its_reservation_reports_the_reserved_node_freed() -> None:
    r = rig(
        gpu_node("n", [gpu("A", 0, count=2)], ours=True), gpu_node("m", [gpu("B", 0, count=2)], ours=True)
    )
    r.add_watched_pod(gpu_pod("p"))
    reserved = r.scheduler.filter(filter_args(gpu_pod("p"), ["n"]))["NodeNames"]
    assert reserved == ["n"]
    freed = reported_freed(r)
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("m"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "m"
    assert freed == ["n"]


async def test_a_refused_bind_reports_its_reservation_freed() -> None:
    r = rig()
    r.add_watched_pod(gpu_pod("p"))
    r.scheduler.filter(filter_args(gpu_pod("p"), ["n"]))
    # Meanwhile another pod took both slots of n's only GPU: p no longer fits.
    both = [[ContainerDevice("A", keys.DEVICE_VENDOR_NVIDIA, 100, 0)] for _ in range(2)]
    x = gpu_pod(
        "x",
        container(gpu=1),
        container(gpu=1),
        node_name="n",
        phase="Running",
        annotations=allocation(allocated=both),
    )
    r.model.apply_pod("ADDED", x)
    freed = reported_freed(r)
    with pytest.raises(BindRefused, match="no longer fits"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert PodUid("uid-ns-p") not in r.model.contributions
    assert freed == ["n"]


def test_a_pod_filtered_again_onto_its_reserved_gpus_reports_nothing_freed() -> None:
    r = rig()
    r.add_watched_pod(gpu_pod("p"))
    assert r.scheduler.filter(filter_args(gpu_pod("p"), ["n"]))["NodeNames"] == ["n"]
    before = r.model.contributions[PodUid("uid-ns-p")]
    freed = reported_freed(r)
    assert r.scheduler.filter(filter_args(gpu_pod("p"), ["n"]))["NodeNames"] == ["n"]
    again = r.model.contributions[PodUid("uid-ns-p")]
    assert (again.source, again.node, again.devices) == ("reserved", "n", before.devices)
    assert freed == []


def test_a_pod_filtered_again_elsewhere_or_nowhere_reports_its_old_node_freed() -> None:
    r = rig(
        gpu_node("n", [gpu("A", 0, count=2)], ours=True), gpu_node("m", [gpu("B", 0, count=2)], ours=True)
    )
    r.add_watched_pod(gpu_pod("p"))
    assert r.scheduler.filter(filter_args(gpu_pod("p"), ["n"]))["NodeNames"] == ["n"]
    freed = reported_freed(r)
    assert r.scheduler.filter(filter_args(gpu_pod("p"), ["m"]))["NodeNames"] == ["m"]
    assert freed == ["n"]
    assert r.scheduler.filter(filter_args(gpu_pod("p"), ["gone"]))["NodeNames"] == []
    assert PodUid("uid-ns-p") not in r.model.contributions
    assert freed == ["n", "m"]
