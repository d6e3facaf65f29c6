"""Leader election against the real API server: two replicas on one Lease, each running its loop.
One leads and the other sees it (and the URL it publishes); a released Lease is taken over at once;
a leader that vanishes without releasing is replaced only once its Lease has expired. At every
change either replica notices, never both lead."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

import pytest

from hamipy.kube.client import RawKube
from hamipy.kube.leader import LeaderElector, LeaseSettings
from hamipy.kube.resources import lease_path
from hamipy.telemetry import make_logger

pytestmark = pytest.mark.integration

LEASE = "hami-leader-test"
URL_KEY = "hami.io/leader-url"
LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S = 3.0, 2.0, 0.5
FIRST_LEADER_S = 10.0
"""Both create the Lease at once; one wins. Generous: the machine may be busy."""


class Replica:
    """One elector and its ``run`` task."""

    def __init__(self, kube: RawKube, namespace: str, identity: str) -> None:
        settings = LeaseSettings(
            namespace=namespace,
            name=LEASE,
            identity=identity,
            lease_duration_s=LEASE_DURATION_S,
            renew_deadline_s=RENEW_DEADLINE_S,
            retry_period_s=RETRY_PERIOD_S,
            api_timeout_s=0.5,
        )
        self.url = f"https://{identity}.test:8443"
        self.elector = LeaderElector(
            kube, settings, logger=make_logger(f"leader-{identity}"), annotations={URL_KEY: self.url}
        )
        self.task = asyncio.create_task(self.elector.run(), name=f"leader-election:{identity}")

    @property
    def identity(self) -> str:
        return self.elector.settings.identity

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def until(replicas: list[Replica], condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for ``condition``, checked at each change either replica notices; at each, never two
    leaders."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                assert sum(r.elector.is_leader() for r in replicas) <= 1, "two leaders"
                if condition():
                    return
                waits = [asyncio.ensure_future(r.elector.wait_changed()) for r in replicas]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
                    await asyncio.gather(*waits, return_exceptions=True)
    except TimeoutError:
        pytest.fail(f"{what}: not within {timeout_s} s")


@pytest.fixture
async def replicas(kube_client: Any, namespace: str) -> AsyncIterator[list[Replica]]:
    kube = RawKube(kube_client)
    started = [Replica(kube, namespace, "a"), Replica(kube, namespace, "b")]
    try:
        yield started
    finally:
        for replica in started:
            await replica.stop()


async def leader_and_follower(replicas: list[Replica]) -> tuple[Replica, Replica]:
    await until(replicas, lambda: any(r.elector.is_leader() for r in replicas), FIRST_LEADER_S, "a leader")
    leader, follower = sorted(replicas, key=lambda r: not r.elector.is_leader())
    return leader, follower


async def lease(kube_client: Any, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = await RawKube(kube_client).request("GET", lease_path(namespace, LEASE))
    return found


async def test_one_replica_leads_and_the_other_sees_it_with_its_annotations(
    kube_client: Any, namespace: str, replicas: list[Replica]
) -> None:
    leader, follower = await leader_and_follower(replicas)
    await until(replicas, lambda: follower.elector.leader is not None, 5.0, "the follower sees the leader")
    seen = follower.elector.leader
    assert seen is not None
    assert (seen.identity, dict(seen.annotations), seen.transitions) == (
        leader.identity,
        {URL_KEY: leader.url},
        0,
    )
    assert leader.elector.leader == seen
    # Renewal after renewal, as the API server tells them: the same holder, and one leader.
    kube = RawKube(kube_client)
    stored = await lease(kube_client, namespace)
    watch = [
        ("watch", "true"),
        ("resourceVersion", stored["metadata"]["resourceVersion"]),
        ("fieldSelector", f"metadata.name={LEASE}"),
    ]
    renewals: list[str] = []
    # RawKube.stream is an async generator: closed here when done, not left to the collector.
    events = cast(
        AsyncGenerator[dict[str, Any], None],
        kube.stream(lease_path(namespace), query=watch, inactivity_s=5.0),
    )
    async with asyncio.timeout(10 * RETRY_PERIOD_S + 5.0), contextlib.aclosing(events):
        async for event in events:
            assert event["type"] == "MODIFIED", event
            spec = event["object"]["spec"]
            assert spec["holderIdentity"] == leader.identity
            assert spec["acquireTime"] == stored["spec"]["acquireTime"]
            assert event["object"]["metadata"]["annotations"] == {URL_KEY: leader.url}
            assert leader.elector.is_leader()
            assert not follower.elector.is_leader()
            renewals.append(spec["renewTime"])
            if len(renewals) == 3:
                break
    assert sorted(set(renewals)) == renewals


async def test_a_released_lease_is_taken_over_within_a_few_retry_periods(
    kube_client: Any, namespace: str, replicas: list[Replica]
) -> None:
    leader, follower = await leader_and_follower(replicas)
    await leader.stop()
    await leader.elector.release()
    assert not leader.elector.is_leader()
    released = time.monotonic()
    await until(replicas, follower.elector.is_leader, LEASE_DURATION_S, "the follower leads")
    took = time.monotonic() - released
    assert took < LEASE_DURATION_S  # not by expiry
    stored = await lease(kube_client, namespace)
    assert stored["spec"]["holderIdentity"] == follower.identity
    assert stored["spec"]["leaseTransitions"] == 1
    assert stored["metadata"]["annotations"] == {URL_KEY: follower.url}


async def test_a_leader_gone_without_release_is_replaced_only_after_the_lease_duration(
    kube_client: Any, namespace: str, replicas: list[Replica]
) -> None:
    leader, follower = await leader_and_follower(replicas)
    await leader.stop()
    stopped = time.monotonic()
    await until(
        replicas,
        follower.elector.is_leader,
        LEASE_DURATION_S + 4 * RETRY_PERIOD_S + 5.0,
        "the follower leads",
    )
    took = time.monotonic() - stopped
    # Its last renewal was sent at most a retry period (and a round) before it stopped; the follower
    # saw it after that and waits the lease duration from there.
    assert took > LEASE_DURATION_S - RETRY_PERIOD_S - 0.2, took
    assert not leader.elector.is_leader()  # fenced long before
    stored = await lease(kube_client, namespace)
    assert stored["spec"]["holderIdentity"] == follower.identity
    assert stored["spec"]["leaseTransitions"] == 1
