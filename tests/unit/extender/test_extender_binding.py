"""Bind against an in-memory API server: lock taking, waiting, breaking, fresh re-check, cleanup,
and lock sessions shared by binds queued on one node."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from builders import container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_args, bind_rig, filter_args, shared_rig

from hamipy.devcluster.waiting import wait_for
from hamipy.extender.errors import BindRefused, LockTimeout
from hamipy.extender.invariant import check_cluster
from hamipy.extender.model import PodUid
from hamipy.kube.errors import KubeError
from hamipy.kube.resources import node_path
from hamipy.protocol import keys
from hamipy.protocol.identifiers import NodeName
from hamipy.protocol.node_lock import NodeLock, format_node_lock, parse_node_lock

SETTINGS = BIND_SETTINGS


async def test_a_bind_on_hamis_node_writes_the_label_and_leaves_the_lock_for_its_plugin() -> None:
    # HAMi's device plugin serves the pod its node lock names: released at bind, the next bind
    # would re-lock the node and this pod's containers be handed the next pod's GPUs.
    r = bind_rig()
    p = gpu_pod("p", container(gpu=1, gpumem=1000, gpucores=20))
    r.kube.add(p)
    result = r.scheduler.filter(filter_args(p, ["n"]))
    assert result["NodeNames"] == ["n"]
    assert (await r.scheduler.bind(bind_args(p)))["Error"] == ""
    stored = r.kube.pod("ns", "p")
    ann = stored["metadata"]["annotations"]
    assert ann[keys.DEVICES_ALLOCATED] == ann[keys.DEVICES_TO_ALLOCATE] == "A,NVIDIA,1000,20:;"
    assert ann[keys.VGPU_NODE] == "n"
    assert ann[keys.BIND_PHASE] == "allocating"
    assert ann[keys.VGPU_TIME] == ann[keys.BIND_TIME]
    assert stored["metadata"]["labels"][keys.VGPU_NODE_LABEL] == "n"
    assert stored["spec"]["nodeName"] == "n"
    lock = parse_node_lock(r.kube.node("n")["metadata"]["annotations"][keys.NODE_LOCK])
    assert (lock.namespace, lock.name) == ("ns", "p")
    assert r.model.contributions[PodUid("uid-ns-p")].source == "allocated"


async def test_a_locked_bind_on_our_node_releases_the_lock_and_writes_no_label() -> None:
    r = shared_rig()
    p = gpu_pod("p")
    r.kube.add(p)
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    stored = r.kube.pod("ns", "p")
    assert stored["spec"]["nodeName"] == "n"
    assert keys.VGPU_NODE_LABEL not in (stored["metadata"].get("labels") or {})
    assert r.lock() is None


async def test_hami_compatible_mode_leaves_the_lock_for_the_device_plugin_on_our_nodes_too() -> None:
    r = shared_rig(dataclasses.replace(SETTINGS, release_lock_after_bind=False))
    p = gpu_pod("p")
    r.kube.add(p)
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    lock = parse_node_lock(r.kube.node("n")["metadata"]["annotations"][keys.NODE_LOCK])
    assert (lock.namespace, lock.name) == ("ns", "p")


async def test_bind_rechecks_fresh_state_and_replans() -> None:
    r = bind_rig(SETTINGS, gpu_node("n", [gpu("A", 0, count=1), gpu("B", 1, count=1)]))
    p = gpu_pod("p")
    r.kube.add(p)
    r.model.apply_pod("ADDED", p)  # the watch delivered it: the filter reserves for it
    r.scheduler.filter(filter_args(p, ["n"]))
    chosen = r.model.contributions[PodUid("uid-ns-p")].devices[0][0].uuid
    other = "B" if chosen == "A" else "A"
    # Another replica bound a pod onto the chosen GPU meanwhile: this model has not seen it.
    r.kube.add(
        gpu_pod(
            "q",
            node_name="n",
            annotations={keys.DEVICES_ALLOCATED: f"{chosen},NVIDIA,1000,0:;"},
            phase="Running",
        )
    )
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["metadata"]["annotations"][keys.DEVICES_ALLOCATED].startswith(other)
    assert (await check_cluster(r.kube)).ok


async def test_bind_refused_when_nothing_fits_any_more_and_cleans_up() -> None:
    r = bind_rig(SETTINGS, gpu_node("n", [gpu("A", 0, count=1)]))
    p = gpu_pod("p")
    r.kube.add(p)
    r.scheduler.filter(filter_args(p, ["n"]))
    r.kube.add(
        gpu_pod("q", node_name="n", annotations={keys.DEVICES_ALLOCATED: "A,NVIDIA,1,0:;"}, phase="Running")
    )
    result = await r.scheduler.bind(bind_args(p))
    assert "1/1 CardTimeSlicingExhausted" in result["Error"]
    assert "uid-ns-p" not in r.model.contributions
    assert keys.NODE_LOCK not in r.kube.node("n")["metadata"]["annotations"]
    assert r.scheduler.events.recorded[-1].reason == "BindingFailed"


async def test_failed_binding_removes_written_annotations() -> None:
    r = bind_rig()
    p = gpu_pod("p")
    r.kube.add(p)
    r.kube.fail(KubeError("boom", status=500), "POST", "/api/v1/namespaces/ns/pods/p/binding")
    result = await r.scheduler.bind(bind_args(p))
    assert "boom" in result["Error"]
    ann = r.kube.pod("ns", "p")["metadata"]["annotations"]
    assert keys.DEVICES_ALLOCATED not in ann
    assert keys.NODE_LOCK not in r.kube.node("n")["metadata"]["annotations"]


@pytest.mark.parametrize(
    ("owner", "age", "reason"),
    [
        pytest.param(None, 0, "owner-gone", id="owner-deleted"),
        pytest.param("Succeeded", 0, "owner-gone", id="owner-finished"),
        pytest.param("deleting", 0, "owner-gone", id="owner-being-deleted"),
        pytest.param("success", 0, "owner-done", id="owner-served"),
        pytest.param("Running", 600, "expired", id="expired"),
    ],
)
async def test_stale_locks_are_broken(owner: str | None, age: int, reason: str) -> None:
    r = bind_rig()
    r.locked_by("ns", "old", datetime.now(UTC) - timedelta(seconds=age))
    if owner in ("Succeeded", "Running"):
        r.kube.add(gpu_pod("old", node_name="n", phase=owner))
    elif owner == "success":
        r.kube.add(gpu_pod("old", node_name="n", phase="Running", annotations={keys.BIND_PHASE: "success"}))
    elif owner == "deleting":  # never served now, though its containers may still run
        old = gpu_pod("old", node_name="n", phase="Running")
        old["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        r.kube.add(old)
    p = gpu_pod("p")
    r.kube.add(p)
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert r.telemetry.metrics.lock_breaks.labels(reason=reason)._value.get() == 1


async def test_live_lock_is_waited_for_then_times_out() -> None:
    r = bind_rig(dataclasses.replace(SETTINGS, bind_timeout_s=0.3))
    r.locked_by("ns", "holder", datetime.now(UTC))
    r.kube.add(gpu_pod("holder", phase="Pending"))
    r.kube.add(gpu_pod("p"))
    with pytest.raises(LockTimeout, match="ns/holder"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))


async def test_waiting_bind_proceeds_once_the_lock_is_released() -> None:
    r = bind_rig()
    r.locked_by("ns", "holder", datetime.now(UTC))
    r.kube.add(gpu_pod("holder", phase="Pending"))
    r.kube.add(gpu_pod("p"))
    task = asyncio.create_task(
        r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    )
    await wait_for(lambda: r.telemetry.metrics.lock_waits._value.get() > 0, timeout=2, interval=0.01)
    del r.kube.node("n")["metadata"]["annotations"][keys.NODE_LOCK]
    await asyncio.wait_for(task, 2)
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"


async def test_concurrent_binds_never_overcommit() -> None:
    r = shared_rig(SETTINGS, gpu_node("n", [gpu("A", 0, count=3)]))
    pods = [gpu_pod(f"p{i}") for i in range(6)]
    for p in pods:
        r.kube.add(p)
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    assert sum(1 for res in results if res["Error"] == "") == 3
    assert (await check_cluster(r.kube)).ok


async def test_bind_of_unknown_or_replaced_pod_is_refused() -> None:
    r = bind_rig()
    with pytest.raises(BindRefused, match="no longer exists"):
        await r.binder.bind(namespace="ns", name="nope", uid=PodUid("x"), node=NodeName("n"))
    r.kube.add(gpu_pod("p"))
    with pytest.raises(BindRefused, match="replaced"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("other"), node=NodeName("n"))


async def test_pod_without_gpu_is_bound_without_lock() -> None:
    r = bind_rig()
    # It names a resource of ours (so kube-scheduler hands it to the extender) but asks no GPU.
    r.kube.add(gpu_pod("p", container(gpumem=1000)))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert ("PATCH", "/api/v1/nodes/n") not in r.kube.calls


# -- lock sessions: binds queued on one node share the lock and the fresh state ------------------------


def _lists(r: BindRig) -> int:
    return sum(1 for method, path in r.kube.calls if method == "GET" and path == "/api/v1/pods")


def _record_lock_owner_at_binds(r: BindRig) -> list[tuple[str, str | None]]:
    """(pod bound, lock owner at that moment) for every Binding carrying an allocation."""
    seen: list[tuple[str, str | None]] = []
    request = r.kube.request

    async def spy(method: str, path: str, **kwargs: Any) -> Any:
        if (
            method == "POST"
            and path.endswith("/binding")
            and kwargs.get("body", {}).get("metadata", {}).get("annotations")
        ):
            value = r.kube.node("n")["metadata"]["annotations"].get(keys.NODE_LOCK)
            seen.append((path.rsplit("/", 2)[1], parse_node_lock(value).name if value else None))
        return await request(method, path, **kwargs)

    r.kube.request = spy  # type: ignore[method-assign]
    return seen


async def test_queued_binds_on_one_node_share_one_lock_session() -> None:
    r = shared_rig(SETTINGS, gpu_node("n", [gpu("A", 0, count=10)]))
    pods = [gpu_pod(f"p{i}") for i in range(5)]
    for p in pods:
        r.kube.add(p)
    owners = _record_lock_owner_at_binds(r)
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    assert [res["Error"] for res in results] == [""] * 5
    assert all(r.kube.pod("ns", f"p{i}")["spec"]["nodeName"] == "n" for i in range(5))
    # Each pod was written while the lock named it, never a pod already served.
    assert sorted(owners) == [(f"p{i}", f"p{i}") for i in range(5)]
    assert _lists(r) == 1, "one fresh re-check (one list) for the whole session"
    assert keys.NODE_LOCK not in r.kube.node("n")["metadata"]["annotations"]
    assert (await check_cluster(r.kube)).ok
    assert not r.binder._sessions


async def test_session_rereads_fresh_state_when_the_node_changed() -> None:
    r = shared_rig(SETTINGS, gpu_node("n", [gpu("A", 0, count=10)]))
    pods = [gpu_pod(f"p{i}") for i in range(3)]
    for p in pods:
        r.kube.add(p)
    request = r.kube.request
    changed: list[str] = []

    async def heartbeat_after_first_binding(method: str, path: str, **kwargs: Any) -> Any:
        result = await request(method, path, **kwargs)
        if path.endswith("/binding") and not changed:
            changed.append(path)
            r.kube.write(node_path("n"), {"metadata": {"annotations": {"example.com/beat": "1"}}})
        return result

    r.kube.request = heartbeat_after_first_binding  # type: ignore[method-assign]
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    assert [res["Error"] for res in results] == [""] * 3
    assert _lists(r) == 2, "the session re-read the node's pods once after the conflict"
    assert keys.NODE_LOCK not in r.kube.node("n")["metadata"]["annotations"]
    assert (await check_cluster(r.kube)).ok


async def test_session_whose_lock_was_broken_takes_the_full_path() -> None:
    r = shared_rig(SETTINGS, gpu_node("n", [gpu("A", 0, count=10)]))
    pods = [gpu_pod(f"p{i}") for i in range(2)]
    for p in pods:
        r.kube.add(p)
    request = r.kube.request
    stolen: list[str] = []

    async def broken_after_first_binding(method: str, path: str, **kwargs: Any) -> Any:
        result = await request(method, path, **kwargs)
        if path.endswith("/binding") and not stolen:
            # Another replica broke our lock and took it; it is long expired by now.
            old = NodeLock(datetime.now(UTC) - timedelta(hours=1), "other", "pod")
            stolen.append(format_node_lock(old))
            r.kube.write(node_path("n"), {"metadata": {"annotations": {keys.NODE_LOCK: stolen[0]}}})
        return result

    r.kube.request = broken_after_first_binding  # type: ignore[method-assign]
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    assert [res["Error"] for res in results] == ["", ""]
    assert r.telemetry.metrics.lock_breaks.labels(reason="expired")._value.get() == 1
    assert keys.NODE_LOCK not in r.kube.node("n")["metadata"]["annotations"]
    assert (await check_cluster(r.kube)).ok
