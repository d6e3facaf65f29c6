"""The node lock as bind keeps it: taken, waited for (a bounded, jittered backoff), broken when
stale, handed from one queued bind to the next (a lock session), released on failure
(docs/extender.md, "Bind and the node lock")."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import types
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from builders import gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_args, bind_rig, shared_rig

from hamipy.devcluster.waiting import wait_for
from hamipy.extender import binding
from hamipy.extender.errors import BindRefused, LockTimeout
from hamipy.extender.invariant import check_cluster
from hamipy.kube.errors import KubeError
from hamipy.kube.resources import node_path
from hamipy.protocol import keys
from hamipy.protocol.identifiers import NodeName, PodUid
from hamipy.protocol.node_lock import parse_node_lock

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
"""The binder's wall clock in the expiry tests: lock ages are counted from it."""
DELAYS = (0.02, 0.04, 0.08, 0.16, 0.25, 0.25)
"""The backoff between looks at a held lock: 20 ms, doubling, at most 250 ms."""
NODE_PATH = "/api/v1/nodes/n"


class VirtualTime:
    """The binder's ``asyncio`` with a virtual clock: a backoff sleep is recorded in ``sleeps``
    and moves the clock at once. ``loop.time()`` is the virtual clock (it starts at 0); deadlines
    (``timeout_at``) are translated to the real loop's, so a mutex wait still times out."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self._real_start: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    def get_running_loop(self) -> VirtualTime:
        if self._real_start is None:
            self._real_start = asyncio.get_running_loop().time()
        return self

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)

    def timeout_at(self, when: float) -> asyncio.Timeout:
        assert self._real_start is not None
        return asyncio.timeout_at(self._real_start + when)


@pytest.fixture
def virtual_time(monkeypatch: pytest.MonkeyPatch) -> VirtualTime:
    """Binds wait on a virtual clock, with the jitter's random draw fixed at 0.5 (sleep = delay)."""
    clock = VirtualTime()
    monkeypatch.setattr(binding, "asyncio", clock)
    monkeypatch.setattr(binding, "random", types.SimpleNamespace(random=lambda: 0.5))
    return clock


def held_by_a_live_pod(r: BindRig, when: datetime = NOW, name: str = "holder") -> str:
    """Lock the node for ``ns/<name>``, a pod still being bound (no bind-phase): not breakable
    until the lock expires."""
    r.kube.add(gpu_pod(name, phase="Pending"))
    return r.locked_by("ns", name, when)


def lock_removals(r: BindRig) -> list[int]:
    """Records, for every write that removes the node lock, how many binds had been created."""
    removals: list[int] = []

    def hook(method: str, path: str, body: Any) -> None:
        if (
            method == "PATCH"
            and path == NODE_PATH
            and body["metadata"]["annotations"].get(keys.NODE_LOCK, 1) is None
        ):
            removals.append(sum(1 for m, p in r.kube.calls if m == "POST" and p.endswith("/binding")))

    r.kube.on_request = hook
    return removals


def breaks(r: BindRig, reason: str) -> float:
    value: float = r.telemetry.metrics.lock_breaks.labels(reason=reason)._value.get()
    return value


# -- expiry: 5 minutes, as upstream ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "age", [timedelta(minutes=4, seconds=59), timedelta(minutes=5)], ids=["4m59s", "5m00s"]
)
async def test_a_lock_up_to_five_minutes_old_is_held(virtual_time: VirtualTime, age: timedelta) -> None:
    r = bind_rig(BIND_SETTINGS, wall_clock=lambda: NOW)
    value = held_by_a_live_pod(r, NOW - age)
    r.kube.add(gpu_pod("p"))
    # Held longer than a bind waits: refused at once, not after waiting 1 s in vain.
    with pytest.raises(LockTimeout, match="node n has been locked by ns/holder since"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert virtual_time.sleeps == []
    assert r.lock() == value
    assert "nodeName" not in r.kube.pod("ns", "p")["spec"]


async def test_a_lock_five_minutes_and_a_second_old_is_broken(virtual_time: VirtualTime) -> None:
    r = bind_rig(BIND_SETTINGS, wall_clock=lambda: NOW)
    held_by_a_live_pod(r, NOW - timedelta(minutes=5, seconds=1))
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert breaks(r, "expired") == 1
    assert virtual_time.sleeps == [], "an expired lock is broken at once"


# -- waiting ------------------------------------------------------------------------------------------


async def test_a_held_lock_is_polled_with_doubling_backoff_until_the_deadline(
    virtual_time: VirtualTime,
) -> None:
    r = bind_rig()
    held_by_a_live_pod(r, datetime.now(UTC))
    r.kube.add(gpu_pod("p"))
    with pytest.raises(LockTimeout, match="node n stayed locked by ns/holder for 1s"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    # 0.80 s slept: the next 250 ms would end past the 1 s deadline, so it gives up instead.
    assert virtual_time.sleeps == list(DELAYS)
    assert r.telemetry.metrics.lock_waits._value.get() == 1, "one wait, however many looks"
    assert sum(1 for call in r.kube.calls if call == ("GET", "/api/v1/namespaces/ns/pods/holder")) == 7


async def test_a_bind_waits_for_its_turn_and_the_lock_within_one_bind_timeout(
    virtual_time: VirtualTime,
) -> None:
    """Two binds of one pod on a held node: the second waits for the first's turn, then for the lock
    until the same deadline, so neither waits longer than ``--bind-timeout`` in all (it stays below
    kube-scheduler's ``httpTimeout``, which would otherwise give up on the bind first)."""
    r = bind_rig()
    held_by_a_live_pod(r, datetime.now(UTC))
    r.kube.add(gpu_pod("p"))

    async def waited() -> float:
        started = virtual_time.now
        with pytest.raises(LockTimeout):
            await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
        return virtual_time.now - started

    first, second = await asyncio.gather(waited(), waited())
    assert first <= BIND_SETTINGS.bind_timeout_s
    assert second <= BIND_SETTINGS.bind_timeout_s, "the lock was waited for a second bind timeout"


async def test_no_sleep_is_started_that_would_end_at_the_deadline(virtual_time: VirtualTime) -> None:
    slept = 0.0
    for delay in DELAYS[:4]:
        slept += delay
    # The deadline falls exactly where the fifth sleep would end.
    r = bind_rig(dataclasses.replace(BIND_SETTINGS, bind_timeout_s=slept + DELAYS[4]))
    held_by_a_live_pod(r, datetime.now(UTC))
    r.kube.add(gpu_pod("p"))
    with pytest.raises(LockTimeout):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert virtual_time.sleeps == list(DELAYS[:4])


@pytest.mark.parametrize(("draw", "factor"), [(0.0, 0.5), (0.9, 1.4)], ids=["shortest", "long"])
async def test_backoff_sleeps_are_jittered_between_half_and_one_and_a_half_delays(
    virtual_time: VirtualTime, monkeypatch: pytest.MonkeyPatch, draw: float, factor: float
) -> None:
    monkeypatch.setattr(binding, "random", types.SimpleNamespace(random=lambda: draw))
    r = bind_rig(dataclasses.replace(BIND_SETTINGS, bind_timeout_s=0.5))
    held_by_a_live_pod(r, datetime.now(UTC))
    r.kube.add(gpu_pod("p"))
    with pytest.raises(LockTimeout):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert virtual_time.sleeps[:3] == pytest.approx([d * factor for d in DELAYS[:3]])


async def test_a_legacy_lock_without_owner_holds_the_node_until_it_expires(virtual_time: VirtualTime) -> None:
    r = bind_rig(BIND_SETTINGS, wall_clock=lambda: NOW)
    value = r.locked_by("ns", None, NOW - timedelta(minutes=1))
    r.kube.add(gpu_pod("p"))
    with pytest.raises(LockTimeout, match=f"locked by a lock taken at {value} since"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.lock() == value
    r.locked_by("ns", None, NOW - timedelta(minutes=6))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert breaks(r, "expired") == 1


# -- taking and breaking ------------------------------------------------------------------------------


async def test_a_lost_race_for_the_lock_looks_again() -> None:
    r = shared_rig()
    r.kube.add(gpu_pod("p"))
    attempts: list[str] = []

    def heartbeat_before_the_first_lock_write(method: str, path: str, body: Any) -> None:
        if method == "PATCH" and path == NODE_PATH:
            attempts.append(body["metadata"]["annotations"][keys.NODE_LOCK] or "release")
            if len(attempts) == 1:
                r.kube.write(node_path("n"), {"metadata": {"annotations": {"example.com/beat": "1"}}})

    r.kube.on_request = heartbeat_before_the_first_lock_write
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert [parse_node_lock(a).name for a in attempts[:2]] == ["p", "p"]
    assert attempts[2:] == ["release"]
    assert r.lock() is None


async def test_a_lock_this_pod_already_holds_is_kept_not_broken() -> None:
    # A retried bind whose first attempt took the lock (HAMi-compatible mode leaves it).
    r = shared_rig()
    r.locked_by("ns", "p", datetime.now(UTC))
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert r.telemetry.metrics.lock_waits._value.get() == 0
    assert all(breaks(r, why) == 0 for why in ("expired", "malformed", "owner-gone", "owner-done"))
    assert r.lock() is None


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        pytest.param("soon", "malformed", id="not-a-time"),
        pytest.param("2026-03-01T12:00:00Z,ns", "malformed", id="two-parts"),
    ],
)
async def test_a_malformed_lock_is_broken(value: str, reason: str) -> None:
    r = bind_rig()
    r.kube.node("n")["metadata"]["annotations"][keys.NODE_LOCK] = value
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert breaks(r, reason) == 1
    assert value in r.log.getvalue(), "the broken lock is logged"


async def test_a_lock_whose_owner_failed_allocation_is_broken() -> None:
    r = bind_rig()
    r.locked_by("ns", "old", datetime.now(UTC))
    r.kube.add(gpu_pod("old", node_name="n", annotations={keys.BIND_PHASE: "failed"}))
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert breaks(r, "owner-done") == 1


async def test_a_bind_that_never_took_the_lock_leaves_the_lock_alone() -> None:
    r = bind_rig()
    r.kube.add(gpu_pod("p"))
    r.kube.remove(node_path("n"))  # deleted between filter and bind
    with pytest.raises(BindRefused, match="node n no longer exists"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.calls == [("GET", "/api/v1/namespaces/ns/pods/p"), ("GET", NODE_PATH)]
    assert "node lock not released" not in r.log.getvalue()


# -- releasing ----------------------------------------------------------------------------------------


async def test_a_bind_releases_its_lock_without_a_warning() -> None:
    r = shared_rig()
    r.kube.add(gpu_pod("p"))
    removals = lock_removals(r)
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert removals == [1], "released once, after the Binding"
    assert r.lock() is None
    assert "node lock not released" not in r.log.getvalue()


async def test_a_release_that_loses_every_race_is_logged_and_left_to_expire() -> None:
    r = shared_rig()
    r.kube.add(gpu_pod("p"))

    def heartbeat_before_every_release(method: str, path: str, body: Any) -> None:
        if (
            method == "PATCH"
            and path == NODE_PATH
            and body["metadata"]["annotations"][keys.NODE_LOCK] is None
        ):
            r.kube.write(
                node_path("n"), {"metadata": {"annotations": {"example.com/beat": str(len(r.kube.calls))}}}
            )

    r.kube.on_request = heartbeat_before_every_release
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n", "the bind itself succeeded"
    lock = r.lock()
    assert lock is not None
    assert parse_node_lock(lock).name == "p"
    assert "every attempt lost a write race" in r.log.getvalue()


# -- one replica's binds on one node: the in-process mutex and lock sessions ----------------------------


async def test_a_bind_queued_behind_this_replicas_binds_gives_up_at_its_deadline() -> None:
    r = shared_rig(
        dataclasses.replace(BIND_SETTINGS, bind_timeout_s=0.2), gpu_node("n", [gpu("A", 0, count=10)])
    )
    for name in ("a", "b", "c", "d"):
        r.kube.add(gpu_pod(name))
    gate = asyncio.Event()
    held: list[str] = []

    async def hold_the_first_allocation(method: str, path: str, body: Any) -> None:
        if method == "POST" and path == "/api/v1/namespaces/ns/pods/a/binding":
            held.append(path)
            await gate.wait()

    r.kube.on_request = hold_the_first_allocation
    first = asyncio.create_task(
        r.binder.bind(namespace="ns", name="a", uid=PodUid("uid-ns-a"), node=NodeName("n"))
    )
    await wait_for(lambda: bool(held), timeout=2, interval=0.005)
    with pytest.raises(LockTimeout, match=re.escape("node n is busy binding other pods; gave up after 0.2s")):
        await r.binder.bind(namespace="ns", name="b", uid=PodUid("uid-ns-b"), node=NodeName("n"))
    gate.set()
    await asyncio.wait_for(first, 2)
    # The bind that gave up no longer counts as waiting: nobody takes over the lock, it is released.
    assert r.lock() is None
    assert not r.binder._sessions
    # And two binds queued later still share one session (one fresh re-check, one list).
    lists_before = sum(1 for call in r.kube.calls if call == ("GET", "/api/v1/pods"))
    await asyncio.gather(*(r.scheduler.bind(bind_args(r.kube.pod("ns", n))) for n in ("c", "d")))
    assert sum(1 for call in r.kube.calls if call == ("GET", "/api/v1/pods")) - lists_before == 1
    assert r.lock() is None
    assert (await check_cluster(r.kube)).ok


def fail_hand_overs(r: BindRig, conflicts: int) -> list[int]:
    """Another writer changes the node before each of the first ``conflicts`` lock writes after
    the first Binding (the hand-overs to the next bind lose the race); returns the lock removals
    as ``lock_removals`` does."""
    removals: list[int] = []
    left = [conflicts]

    def hook(method: str, path: str, body: Any) -> None:
        if method != "PATCH" or path != NODE_PATH:
            return
        bound = sum(1 for m, p in r.kube.calls if m == "POST" and p.endswith("/binding"))
        value = body["metadata"]["annotations"][keys.NODE_LOCK]
        if value is None:
            removals.append(bound)
        elif bound and left[0]:
            left[0] -= 1
            r.kube.write(node_path("n"), {"metadata": {"annotations": {"example.com/beat": str(left[0])}}})

    r.kube.on_request = hook
    return removals


async def test_a_session_survives_four_lost_hand_overs() -> None:
    r = shared_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=10)]))
    pods = [gpu_pod("p0"), gpu_pod("p1")]
    for p in pods:
        r.kube.add(p)
    removals = fail_hand_overs(r, 4)
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    assert [res["Error"] for res in results] == ["", ""]
    assert removals == [2], "the lock was handed over, never released between the binds"
    assert (await check_cluster(r.kube)).ok


async def test_after_five_lost_hand_overs_the_lock_is_freed_and_the_bind_takes_it_anew() -> None:
    # The lock still names p0, bound but not served: the full path must not wait for it.
    r = shared_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=10)]))
    pods = [gpu_pod("p0"), gpu_pod("p1")]
    for p in pods:
        r.kube.add(p)
    removals = fail_hand_overs(r, 5)
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    assert [res["Error"] for res in results] == ["", ""]
    assert removals == [1, 2], "p0's lock freed after the fifth lost race, p1's after its bind"
    assert r.telemetry.metrics.lock_waits._value.get() == 0
    assert r.lock() is None
    assert (await check_cluster(r.kube)).ok


async def test_a_session_bind_that_no_longer_fits_releases_the_lock() -> None:
    r = shared_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=1)]))
    pods = [gpu_pod("p0"), gpu_pod("p1")]
    for p in pods:
        r.kube.add(p)
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    assert results[0]["Error"] == ""
    assert "pod no longer fits node n" in results[1]["Error"]
    assert r.lock() is None
    assert not r.binder._sessions
    assert "uid-ns-p1" not in r.model.contributions


@pytest.mark.parametrize("failing", ["hand-over", "re-read"])
async def test_a_session_hand_over_that_fails_frees_the_lock(failing: str) -> None:
    # hand-over: the write that would name p1 fails, the lock still names p0.
    # re-read: p1 took the lock after a lost race, then reading the node's pods failed.
    r = shared_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=10)]))
    pods = [gpu_pod("p0"), gpu_pod("p1")]
    for p in pods:
        r.kube.add(p)
    state = {"armed": True, "beat": False}

    def hook(method: str, path: str, body: Any) -> None:
        bound = any(m == "POST" and p.endswith("/binding") for m, p in r.kube.calls)
        if not bound or not state["armed"]:
            return
        if method == "PATCH" and path == NODE_PATH and body["metadata"]["annotations"][keys.NODE_LOCK]:
            if failing == "hand-over":
                state["armed"] = False
                raise KubeError("boom", status=500)
            if not state["beat"]:
                state["beat"] = True
                r.kube.write(node_path("n"), {"metadata": {"annotations": {"example.com/beat": "1"}}})
        if failing == "re-read" and method == "GET" and path == "/api/v1/pods":
            state["armed"] = False
            raise KubeError("boom", status=500)

    r.kube.on_request = hook
    results = await asyncio.gather(*(r.scheduler.bind(bind_args(p)) for p in pods))
    assert results[0]["Error"] == ""
    assert "API error while binding to n: boom" in results[1]["Error"]
    assert r.lock() is None, "neither p0's nor p1's lock is left behind"
    assert "nodeName" not in r.kube.pod("ns", "p1")["spec"]
