"""Lease-based leader election: acquiring, renewing, expiry judged by local observation only, fencing
by the renew deadline, lost races, release, and the settings' checks. Rounds are driven one by one
(``try_acquire_or_renew``) on a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fake_kube import FakeKube
from kube_support import running_task

from hamipy.kube.errors import KubeError
from hamipy.kube.leader import LeaderElector, LeaderInfo, LeaseSettings
from hamipy.kube.resources import lease_path

NS, NAME = "hami-system", "hami-scheduler"
PATH = lease_path(NS, NAME)
WALL_START = datetime(2025, 6, 18, 9, 6, 27, 123456, tzinfo=UTC)
URL = {"hami.io/leader-url": "https://10.0.0.1:443"}
DOWN = KubeError("GET leases: ClientConnectorError: connection refused")


class Clock:
    """A monotonic clock the test moves (each replica's own, possibly far from the others')."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return WALL_START + timedelta(seconds=self.now - 1000.0)


class Logs:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))

    def events(self, level: str) -> list[str]:
        return [event for lvl, event, _ in self.lines if lvl == level]


def lease_spec(store: FakeKube) -> dict[str, Any]:
    """The Lease's spec as stored."""
    lease_spec: dict[str, Any] = store.get(PATH)["spec"]
    return lease_spec


def intrude(client: FakeKube, lease: dict[str, Any]) -> None:
    """Another replica's write of ``lease`` lands just before ``client``'s next write."""

    def first(method: str, path: str, body: Any) -> None:
        if method in ("POST", "PUT"):
            client.on_request = None
            client.add(lease)

    client.on_request = first


async def hang(method: str, path: str, body: Any) -> None:
    """A request that never gets an answer."""
    await asyncio.Event().wait()


def settings(identity: str, **timing: float) -> LeaseSettings:
    return LeaseSettings(namespace=NS, name=NAME, identity=identity, **timing)


def elector(
    store: FakeKube,
    identity: str,
    clock: Clock,
    *,
    annotations: dict[str, str] | None = None,
    **timing: float,
) -> tuple[LeaderElector, FakeKube, Logs]:
    """A replica's elector over its own client of ``store``'s API server."""
    client, logs = store.connect(), Logs()
    e = LeaderElector(
        client,
        settings(identity, **timing),
        logger=logs,
        annotations=annotations or {},
        clock=clock,
        wall_clock=clock.wall,
        random_fraction=lambda: 0.5,
    )
    return e, client, logs


def holder(e: LeaderElector) -> str | None:
    leader = e.leader
    return None if leader is None else leader.identity


def foreign_lease(holder: str, *, renew: str = "2025-06-18T09:06:27.000000Z", transitions: int = 3) -> Any:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "annotations": {"hami.io/leader-url": f"https://{holder}"},
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "acquireTime": renew,
            "renewTime": renew,
            "leaseTransitions": transitions,
        },
    }


# --- acquiring ---------------------------------------------------------------------------------


async def test_creates_the_lease_when_there_is_none_and_leads() -> None:
    store, clock = FakeKube(), Clock()
    a, _, logs = elector(store, "a", clock, annotations=URL, lease_duration_s=14.2)
    assert await a.try_acquire_or_renew() is True
    assert store.calls == [("GET", PATH), ("POST", lease_path(NS))]
    lease = store.get(PATH)
    assert lease["metadata"]["annotations"] == URL
    assert lease["spec"] == {
        "holderIdentity": "a",
        "leaseDurationSeconds": 15,  # 14.2 rounded up: others wait at least as long as we think
        "acquireTime": "2025-06-18T09:06:27.123456Z",
        "renewTime": "2025-06-18T09:06:27.123456Z",
        "leaseTransitions": 0,
    }
    assert a.is_leader()
    assert a.leader == LeaderInfo(identity="a", annotations=URL, transitions=0)
    assert [r.timeout_s for r in store.requests] == [4.0, 4.0]
    assert logs.events("info") == ["became leader"]


async def test_a_create_that_loses_to_another_replica_observes_it_next_round() -> None:
    store, clock = FakeKube(), Clock()
    a, client, logs = elector(store, "a", clock)
    intrude(client, foreign_lease("b"))
    assert await a.try_acquire_or_renew() is False
    assert logs.events("info") == ["another replica created the lease first"]
    assert holder(a) is None  # not read yet
    assert await a.try_acquire_or_renew() is False
    assert holder(a) == "b"


async def test_a_fresh_foreign_lease_is_not_taken_and_its_holder_is_the_leader() -> None:
    store, clock = FakeKube(), Clock()
    store.add(foreign_lease("b"))
    a, _, _ = elector(store, "a", clock)
    assert await a.try_acquire_or_renew() is False
    assert store.calls == [("GET", PATH)]
    assert a.leader == LeaderInfo(
        identity="b", annotations={"hami.io/leader-url": "https://b"}, transitions=3
    )
    assert not a.is_leader()


@pytest.mark.parametrize(
    "renew_time",
    ["2000-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z"],
    ids=["remote-time-long-past", "remote-time-in-the-future"],
)
async def test_a_foreign_lease_is_taken_only_after_its_duration_of_unchanged_local_observation(
    renew_time: str,
) -> None:
    store, clock = FakeKube(), Clock()
    store.add(foreign_lease("b", renew=renew_time))
    a, _, _ = elector(store, "a", clock, annotations=URL)
    assert await a.try_acquire_or_renew() is False  # first seen now, whatever its renewTime says
    clock.now += 15.0
    assert await a.try_acquire_or_renew() is False  # exactly the duration: not yet
    assert holder(a) == "b"
    clock.now += 0.001
    assert holder(a) is None  # expired by local observation
    assert await a.try_acquire_or_renew() is True
    spec = lease_spec(store)
    assert spec["holderIdentity"] == "a"
    assert spec["leaseTransitions"] == 4
    assert spec["acquireTime"] == spec["renewTime"] == "2025-06-18T09:06:42.124456Z"
    assert store.get(PATH)["metadata"]["annotations"] == URL  # the former holder's are gone


async def test_a_foreign_lease_that_changes_restarts_the_wait() -> None:
    store, clock = FakeKube(), Clock()
    store.add(foreign_lease("b", renew="2025-06-18T09:06:27.000000Z"))
    a, _, _ = elector(store, "a", clock)
    assert await a.try_acquire_or_renew() is False
    clock.now += 10.0
    store.add(foreign_lease("b", renew="2025-06-18T09:06:37.000000Z"))  # b renewed
    assert await a.try_acquire_or_renew() is False
    clock.now += 10.0  # 20 s after the first sight, 10 s after the change
    assert await a.try_acquire_or_renew() is False
    clock.now += 5.001
    assert await a.try_acquire_or_renew() is True


async def test_a_lease_without_a_holder_is_taken_at_once() -> None:
    store, clock = FakeKube(), Clock()
    lease = foreign_lease("")
    store.add(lease)
    a, _, _ = elector(store, "a", clock)
    assert holder(a) is None
    assert await a.try_acquire_or_renew() is True
    assert lease_spec(store)["leaseTransitions"] == 4


# --- renewing and fencing ----------------------------------------------------------------------


async def test_the_leader_renews_without_reading_and_keeps_its_acquire_time() -> None:
    store, clock = FakeKube(), Clock()
    a, _, _ = elector(store, "a", clock)
    await a.try_acquire_or_renew()
    store.requests.clear()
    clock.now += 2.0
    assert await a.try_acquire_or_renew() is True
    assert store.calls == [("PUT", PATH)]
    spec = lease_spec(store)
    assert spec["acquireTime"] == "2025-06-18T09:06:27.123456Z"
    assert spec["renewTime"] == "2025-06-18T09:06:29.123456Z"
    assert spec["leaseTransitions"] == 0
    clock.now += 9.999  # the deadline runs from the last renewal
    assert a.is_leader()


async def test_a_leader_that_cannot_renew_stops_leading_at_the_renew_deadline() -> None:
    store, clock = FakeKube(), Clock()
    a, client, logs = elector(store, "a", clock)
    await a.try_acquire_or_renew()
    changed = asyncio.ensure_future(a.wait_changed())
    client.fail(DOWN)
    for _ in range(4):
        clock.now += 2.0
        assert await a.try_acquire_or_renew() is True  # still within the deadline
    clock.now += 1.999
    assert a.is_leader()
    clock.now += 0.001
    assert not a.is_leader()  # fenced at once, before any round notices
    assert holder(a) is None
    assert not changed.done()
    assert await a.try_acquire_or_renew() is False
    assert "lease not renewed within the renew deadline; stepping down" in logs.events("warning")
    await asyncio.wait_for(changed, 1)
    # The API back, the Lease still names us and nobody wrote it since: taken again, no transition.
    client.heal()
    assert await a.try_acquire_or_renew() is True
    assert lease_spec(store)["leaseTransitions"] == 0
    assert logs.events("info").count("became leader") == 2


async def test_never_two_leaders_while_the_leader_is_cut_off() -> None:
    """Both replicas step every 0.25 s; ``a`` is cut off from the API from 3 s to 30 s."""
    store, clock = FakeKube(), Clock()
    a, a_client, _ = elector(store, "a", clock)
    b, _, _ = elector(store, "b", clock)
    leaders: list[tuple[float, str]] = []
    for tick in range(160):
        t = tick * 0.25
        clock.now = 1000.0 + t
        a_client.heal()
        if 3.0 <= t < 30.0:
            a_client.fail(DOWN)
        for e in (a, b):
            await e.try_acquire_or_renew()
            assert not (a.is_leader() and b.is_leader()), f"two leaders at {t} s"
        now = [e.settings.identity for e in (a, b) if e.is_leader()]
        if not leaders or leaders[-1][1] != (now[0] if now else ""):
            leaders.append((t, now[0] if now else ""))
    # a renewed last at 2.75 s: fenced at 12.75 s; b saw that renewal at 2.75 s: takes over after 17.75.
    assert leaders == [(0.0, "a"), (12.75, ""), (18.0, "b")]
    assert lease_spec(store)["leaseTransitions"] == 1
    assert holder(b) == "b"
    assert holder(a) == "b"


async def test_a_leader_that_finds_another_holder_steps_down_at_once() -> None:
    store, clock = FakeKube(), Clock()
    a, _, logs = elector(store, "a", clock)
    await a.try_acquire_or_renew()
    store.add(foreign_lease("b"))  # e.g. a replica with a shorter lease duration
    clock.now += 2.0
    assert await a.try_acquire_or_renew() is False
    assert store.calls[-2:] == [("PUT", PATH), ("GET", PATH)]  # fast path lost; read; not taken
    assert "another replica holds the lease; stepping down" in logs.events("warning")
    assert holder(a) == "b"


async def test_a_takeover_that_loses_the_race_does_not_lead() -> None:
    store, clock = FakeKube(), Clock()
    store.add(foreign_lease(""))
    a, client, logs = elector(store, "a", clock)
    intrude(client, foreign_lease("b", transitions=4))
    assert await a.try_acquire_or_renew() is False
    assert logs.events("info") == ["lost a race for the lease"]
    assert lease_spec(store)["holderIdentity"] == "b"
    assert await a.try_acquire_or_renew() is False  # b's, fresh
    assert holder(a) == "b"


async def test_api_errors_are_logged_and_never_raised() -> None:
    store, clock = FakeKube(), Clock()
    a, client, logs = elector(store, "a", clock)
    client.fail(DOWN)
    assert await a.try_acquire_or_renew() is False
    assert logs.lines == [
        (
            "warning",
            "leader election round failed",
            {"lease": f"{NS}/{NAME}", "error": str(DOWN), "leading": False},
        )
    ]
    client.heal()
    assert await a.try_acquire_or_renew() is True


# --- release and transitions -------------------------------------------------------------------


async def test_release_frees_the_lease_and_another_replica_takes_it_at_once() -> None:
    store, clock = FakeKube(), Clock()
    a, _, a_logs = elector(store, "a", clock, annotations=URL)
    b, _, _ = elector(store, "b", clock, annotations={"hami.io/leader-url": "https://b"})
    await a.try_acquire_or_renew()
    await b.try_acquire_or_renew()
    assert b.leader == LeaderInfo(identity="a", annotations=URL, transitions=0)
    changed = asyncio.ensure_future(a.wait_changed())
    await a.release()
    await asyncio.wait_for(changed, 1)
    assert not a.is_leader()
    assert holder(a) is None
    assert lease_spec(store) == {
        "holderIdentity": "",
        "leaseDurationSeconds": 1,
        "acquireTime": "2025-06-18T09:06:27.123456Z",
        "renewTime": "2025-06-18T09:06:27.123456Z",
        "leaseTransitions": 0,
    }
    assert store.get(PATH)["metadata"]["annotations"] == {}
    assert a_logs.events("info") == ["became leader", "released the lease"]
    assert await b.try_acquire_or_renew() is True  # at once: no holder
    assert lease_spec(store)["leaseTransitions"] == 1
    assert await a.try_acquire_or_renew() is False
    assert a.leader == LeaderInfo(
        identity="b", annotations={"hami.io/leader-url": "https://b"}, transitions=1
    )
    # Every change of holder counts, a release and its taker's too.
    await b.release()
    assert await a.try_acquire_or_renew() is True
    assert lease_spec(store)["leaseTransitions"] == 2


async def test_the_holder_writes_exactly_its_own_annotations() -> None:
    store, clock = FakeKube(), Clock()
    a, _, _ = elector(store, "a", clock, annotations=URL)
    await a.try_acquire_or_renew()
    lease = store.get(PATH)
    lease["metadata"]["annotations"]["someone.else/note"] = "x"
    store.add(lease)
    clock.now += 2.0
    assert await a.try_acquire_or_renew() is True  # the fast path lost to that write; read, renewed
    assert store.get(PATH)["metadata"]["annotations"] == URL


async def test_release_reads_a_lease_written_since_and_releases_it_if_still_ours() -> None:
    store, clock = FakeKube(), Clock()
    a, _, logs = elector(store, "a", clock, annotations=URL)
    await a.try_acquire_or_renew()
    lease = store.get(PATH)
    lease["metadata"]["annotations"]["someone.else/note"] = "x"
    store.add(lease)
    await a.release()
    assert store.calls[-3:] == [("PUT", PATH), ("GET", PATH), ("PUT", PATH)]
    assert lease_spec(store)["holderIdentity"] == ""
    assert store.get(PATH)["metadata"]["annotations"] == {"someone.else/note": "x"}
    assert logs.events("warning") == []


async def test_release_of_a_lease_taken_meanwhile_leaves_it_alone() -> None:
    store, clock = FakeKube(), Clock()
    a, _, logs = elector(store, "a", clock)
    await a.try_acquire_or_renew()
    store.add(foreign_lease("b"))
    await a.release()
    assert lease_spec(store)["holderIdentity"] == "b"
    assert logs.events("warning") == []
    assert holder(a) == "b"


async def test_release_that_fails_is_logged_and_the_replica_stops_leading() -> None:
    store, clock = FakeKube(), Clock()
    a, client, logs = elector(store, "a", clock)
    await a.try_acquire_or_renew()
    client.fail(DOWN)
    await a.release()
    assert not a.is_leader()
    assert logs.events("warning") == ["could not release the lease; it expires after its duration"]
    assert lease_spec(store)["holderIdentity"] == "a"


async def test_release_of_a_lease_held_by_another_writes_nothing() -> None:
    store, clock = FakeKube(), Clock()
    store.add(foreign_lease("b"))
    a, _, _ = elector(store, "a", clock)
    await a.release()
    await a.try_acquire_or_renew()
    await a.release()
    assert store.calls == [("GET", PATH)]


# --- waiting and the loop ----------------------------------------------------------------------


async def test_wait_leader_returns_the_leader_or_none_after_the_timeout() -> None:
    store, clock = FakeKube(), Clock()
    a, _, _ = elector(store, "a", clock, annotations=URL)
    assert await a.wait_leader(0.01) is None
    waiting = asyncio.ensure_future(a.wait_leader(5))
    await a.try_acquire_or_renew()
    assert await asyncio.wait_for(waiting, 1) == LeaderInfo(identity="a", annotations=URL, transitions=0)


def test_rounds_are_jittered_while_not_leading() -> None:
    a, _, _ = elector(FakeKube(), "a", Clock())
    assert a.next_delay_s() == pytest.approx(2.0 * (1 + 1.2 * 0.5))


async def test_rounds_while_leading_come_every_retry_period_and_never_after_the_deadline() -> None:
    clock = Clock()
    a, client, _ = elector(FakeKube(), "a", clock)
    await a.try_acquire_or_renew()
    assert a.next_delay_s() == 2.0
    client.fail(DOWN)
    clock.now += 9.0
    await a.try_acquire_or_renew()
    assert a.next_delay_s() == pytest.approx(1.0)


FAST = LeaseSettings(
    namespace=NS,
    name=NAME,
    identity="a",
    lease_duration_s=1.0,
    renew_deadline_s=0.3,
    retry_period_s=0.01,
    api_timeout_s=0.1,
)


def running(e: LeaderElector) -> contextlib.AbstractAsyncContextManager[asyncio.Task[None]]:
    return running_task(e.run(), f"leader-election:{e.settings.identity}")


async def test_run_survives_api_errors_and_acquires() -> None:
    client, logs = FakeKube(), Logs()
    client.fail(KubeError("GET lease: HTTP 503: unavailable", status=503), times=3)
    a = LeaderElector(client, FAST, logger=logs)
    async with running(a) as task:
        assert await a.wait_leader(5) is not None
        assert a.is_leader()
        assert not task.done()
    assert logs.events("warning") == ["leader election round failed"] * 3


async def test_run_steps_down_at_the_deadline_while_a_renewal_hangs() -> None:
    client, logs = FakeKube(), Logs()
    a = LeaderElector(client, FAST, logger=logs)
    async with running(a):
        assert await a.wait_leader(5) is not None
        client.on_request = hang
        async with asyncio.timeout(5):
            while a.is_leader():
                await a.wait_changed()
        # Told by the loop itself, not found later: the step-down is logged already.
        assert logs.events("warning") == ["lease not renewed within the renew deadline; stepping down"]


# --- settings ----------------------------------------------------------------------------------


def test_the_default_timing_is_client_gos_with_room_for_the_api_timeout() -> None:
    s = settings("a")
    assert (s.lease_duration_s, s.renew_deadline_s, s.retry_period_s, s.api_timeout_s) == (15, 10, 2, 4)


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        ({"lease_duration_s": 14.0}, r"lease_duration_s \(14.0\) must exceed renew_deadline_s \(10.0\)"),
        ({"api_timeout_s": 5.0}, r"\+ api_timeout_s \(5.0\)"),
        ({"retry_period_s": 10.0}, r"renew_deadline_s \(10.0\) must exceed retry_period_s \(10.0\)"),
        ({"retry_period_s": 0.0}, r"retry_period_s must be positive, not 0.0"),
        ({"api_timeout_s": -1.0}, r"api_timeout_s must be positive"),
    ],
    ids=[
        "lease-not-past-deadline",
        "lease-not-past-deadline-plus-timeout",
        "deadline-not-past-retry",
        "retry-zero",
        "timeout-negative",
    ],
)
def test_settings_that_cannot_fence_are_refused(timing: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings("a", **timing)


@pytest.mark.parametrize("field", ["namespace", "name", "identity"])
def test_settings_name_the_lease_and_the_replica(field: str) -> None:
    names = {"namespace": NS, "name": NAME, "identity": "a", field: ""}
    with pytest.raises(ValueError, match=f"LeaseSettings.{field} must not be empty"):
        LeaseSettings(namespace=names["namespace"], name=names["name"], identity=names["identity"])
