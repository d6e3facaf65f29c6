"""Node locks nobody else frees (docs/extender.md#stuck-locks): a release the API failed is retried
by the lock sweep until it lands; a lock held past a bind's wait by a pod that is gone or served is
freed; meanwhile the filter passes such a node over, and a bind there is refused at once."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from builders import REPORT, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_args, bind_rig, filter_args, shared_rig

from hamipy.extender.settings import ExtenderSettings
from hamipy.kube.errors import KubeError
from hamipy.protocol import keys
from hamipy.protocol.identifiers import NodeName, PodUid

NODE_PATH = "/api/v1/nodes/n"


def freed(r: BindRig, reason: str) -> float:
    value: float = r.telemetry.metrics.lock_breaks.labels(reason=reason)._value.get()
    return value


def owed(r: BindRig) -> float:
    value: float = r.telemetry.metrics.lock_releases_owed._value.get()
    return value


def removing_the_lock(method: str, path: str, body: Any) -> bool:
    return bool(
        method == "PATCH"
        and path == NODE_PATH
        and keys.NODE_LOCK in body["metadata"]["annotations"]
        and body["metadata"]["annotations"][keys.NODE_LOCK] is None
    )


def api_down_for_releases(r: BindRig) -> dict[str, bool]:
    """Every lock removal fails (the API server is away) until ``state["down"]`` is cleared."""
    state = {"down": True}

    def hook(method: str, path: str, body: Any) -> None:
        if state["down"] and removing_the_lock(method, path, body):
            raise KubeError("connection refused")

    r.kube.on_request = hook
    return state


async def test_a_release_the_api_failed_is_retried_until_it_lands() -> None:
    r = shared_rig()
    r.kube.add(gpu_pod("p"))
    state = api_down_for_releases(r)
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n", "the bind itself landed"
    assert r.lock() is not None, "its release did not"
    assert r.binder.sweeper.owed == {"n": ("ns", "p")}
    assert owed(r) == 1
    await r.binder.sweeper.sweep()
    assert r.lock() is not None, "still down: still owed"
    assert r.binder.sweeper.owed == {"n": ("ns", "p")}
    state["down"] = False
    await r.binder.sweeper.sweep()
    assert r.lock() is None
    assert r.binder.sweeper.owed == {}
    assert owed(r) == 0
    assert freed(r, "released-late") == 1


async def test_an_owed_release_never_removes_a_lock_that_names_another_pod() -> None:
    r = bind_rig()
    r.kube.add(gpu_pod("p"))
    state = api_down_for_releases(r)
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    state["down"] = False
    other = r.locked_by("ns", "other", datetime.now(UTC))
    await r.binder.sweeper.sweep()
    assert r.lock() == other
    assert r.binder.sweeper.owed == {}, "nothing of ours is left to release"
    assert freed(r, "released-late") == 0


async def test_a_node_locked_again_by_a_bind_of_ours_is_no_longer_owed() -> None:
    # HAMi's discipline (lock held until Allocate): the second bind of p leaves its lock for the
    # device plugin; the sweep must not take it away.
    settings = dataclasses.replace(BIND_SETTINGS, release_lock_after_bind=False)
    r = bind_rig(settings, gpu_node("n", [gpu("A", 0, count=4)]))
    r.kube.add(gpu_pod("p"))
    r.binder.sweeper.owe(NodeName("n"), "ns", "p")  # an earlier bind of p failed, and so did its release
    r.locked_by("ns", "p", datetime.now(UTC))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.binder.sweeper.owed == {}
    await r.binder.sweeper.sweep()
    assert r.lock() is not None, "the lock stays for the device plugin"


async def test_a_node_this_replica_is_binding_on_is_skipped() -> None:
    r = bind_rig()
    r.locked_by("ns", "p", datetime.now(UTC))
    r.binder.sweeper.owe(NodeName("n"), "ns", "p")
    await r.binder._mutexes.setdefault(NodeName("n"), asyncio.Lock()).acquire()
    await r.binder.sweeper.sweep()
    assert r.lock() is not None
    r.binder._mutexes[NodeName("n")].release()
    await r.binder.sweeper.sweep()
    assert r.lock() is None


def stuck_rig(owner_phase: str | None, *, deciding: bool = True) -> BindRig:
    """Node ``n`` locked 30 s ago (a bind waits 1 s) by ``ns/holder``; the holder pod absent
    (``owner_phase`` None), pending, or served (a ``bind-phase``)."""
    r = bind_rig()
    r.binder.sweeper.deciding = lambda: deciding
    if owner_phase is not None:
        holder = gpu_pod("holder", phase="Pending")
        if owner_phase != "pending":
            holder["metadata"].setdefault("annotations", {})[keys.BIND_PHASE] = owner_phase
        r.kube.add(holder)
    r.locked_by("ns", "holder", datetime.now(UTC) - timedelta(seconds=30))
    r.model.apply_node("MODIFIED", r.kube.node("n"))
    return r


async def test_a_stuck_lock_whose_owner_is_gone_or_served_is_freed() -> None:
    for phase, reason in ((None, "owner-gone"), ("success", "owner-done"), ("failed", "owner-done")):
        r = stuck_rig(phase)
        await r.binder.sweeper.sweep()
        assert r.lock() is None, phase
        assert freed(r, reason) == 1, phase


async def test_a_stuck_lock_whose_owner_is_still_being_bound_is_left() -> None:
    r = stuck_rig("pending")
    await r.binder.sweeper.sweep()
    assert r.lock() is not None


def bound_owner_rig(settings: ExtenderSettings, *, ours: bool = True, bound_to: str = "n") -> BindRig:
    """Node ``n`` (registered by our device plugin, or by HAMi's) locked 30 s ago by ``ns/holder``,
    bound to ``bound_to`` but not yet served (``allocating``): its binder died between its Binding
    and its release."""
    n = gpu_node("n", [gpu("A", 0, count=2)], annotations=dict(REPORT) if ours else None)
    r = bind_rig(settings, n)
    holder = gpu_pod("holder", node_name=bound_to, annotations={keys.BIND_PHASE: "allocating"})
    r.kube.add(holder)
    r.locked_by("ns", "holder", datetime.now(UTC) - timedelta(seconds=30))
    r.model.apply_node("MODIFIED", r.kube.node("n"))
    return r


async def test_a_stuck_lock_whose_owner_is_bound_is_freed_when_locks_last_only_for_the_bind() -> None:
    r = bound_owner_rig(BIND_SETTINGS)
    await r.binder.sweeper.sweep()
    assert r.lock() is None
    assert freed(r, "owner-bound") == 1


async def test_a_bound_owners_lock_is_left_for_the_device_plugin_when_held_until_allocate() -> None:
    held_everywhere = dataclasses.replace(BIND_SETTINGS, release_lock_after_bind=False)
    for r in (bound_owner_rig(held_everywhere), bound_owner_rig(BIND_SETTINGS, ours=False)):
        await r.binder.sweeper.sweep()
        assert r.lock() is not None
        assert freed(r, "owner-bound") == 0


async def test_a_lock_whose_owner_is_bound_to_another_node_is_freed_whoever_serves_it() -> None:
    r = bound_owner_rig(BIND_SETTINGS, ours=False, bound_to="m")
    await r.binder.sweeper.sweep()
    assert r.lock() is None
    assert freed(r, "owner-bound") == 1


async def test_only_the_deciding_replica_sweeps_stuck_locks() -> None:
    r = stuck_rig(None, deciding=False)
    await r.binder.sweeper.sweep()
    assert r.lock() is not None
    assert ("GET", "/api/v1/namespaces/ns/pods/holder") not in r.kube.calls


async def test_a_young_lock_is_not_checked() -> None:
    r = bind_rig()
    r.locked_by("ns", "holder", datetime.now(UTC))
    r.model.apply_node("MODIFIED", r.kube.node("n"))
    await r.binder.sweeper.sweep()
    assert r.lock() is not None
    assert r.kube.calls == []


# -- the filter and the bind do not wait for a stuck lock ----------------------------------------------


def two_nodes_one_stuck() -> BindRig:
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=4)]), gpu_node("m", [gpu("B", 0, count=4)]))
    r.kube.add(gpu_pod("holder", phase="Pending"))
    r.locked_by("ns", "holder", datetime.now(UTC) - timedelta(seconds=30))
    r.model.apply_node("MODIFIED", r.kube.node("n"))
    return r


async def test_the_filter_passes_over_a_node_whose_lock_is_stuck() -> None:
    r = two_nodes_one_stuck()
    r.add_watched_pod(gpu_pod("p"))
    result = r.scheduler.filter(filter_args(r.kube.pod("ns", "p"), ["n", "m"]))
    assert result["NodeNames"] == ["m"]
    # With m gone too, the reason names the lock.
    result = r.scheduler.filter(filter_args(r.kube.pod("ns", "p"), ["n"]))
    assert result["NodeNames"] == []
    assert "NodeLockHeld: node lock held by ns/holder since" in result["FailedNodes"]["n"]


async def test_the_lock_owner_itself_may_still_be_placed_on_its_node() -> None:
    r = two_nodes_one_stuck()
    holder = r.kube.pod("ns", "holder")
    r.model.apply_pod("ADDED", holder)
    result = r.scheduler.filter(filter_args(holder, ["n"]))
    assert result["NodeNames"] == ["n"]


async def test_a_young_lock_does_not_keep_the_filter_away() -> None:
    r = bind_rig()
    r.kube.add(gpu_pod("holder", phase="Pending"))
    r.locked_by("ns", "holder", datetime.now(UTC))
    r.model.apply_node("MODIFIED", r.kube.node("n"))
    r.add_watched_pod(gpu_pod("p"))
    result = r.scheduler.filter(filter_args(r.kube.pod("ns", "p"), ["n"]))
    assert result["NodeNames"] == ["n"]


async def test_a_bind_to_a_node_whose_lock_is_stuck_is_refused_at_once() -> None:
    r = two_nodes_one_stuck()
    r.kube.add(gpu_pod("p"))
    answer = await r.scheduler.bind(bind_args(r.kube.pod("ns", "p")))
    assert "node n has been locked by ns/holder since" in answer["Error"]
    assert r.telemetry.metrics.lock_waits._value.get() == 0, "it did not wait"
