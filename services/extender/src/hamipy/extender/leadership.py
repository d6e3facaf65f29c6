"""Which replica decides, when several run (docs/extender.md#replicas).

One replica, the holder of a Lease (``hamipy.kube.leader``), answers every ``/filter``,
``/prioritize`` and ``/bind``; the others forward them to it over HTTP(S) and answer what it
answered. So every decision comes from one model: its filters' reservations and its binds in flight
are seen by the next filter at once, whichever replica kube-scheduler's connection reached, and
replicas never pick the same GPUs. A follower never decides or binds on its own: the leader binds
without the node lock on nodes our device plugin serves, so a follower's bind could not be made safe
beside it. With no leader known a follower waits for one (``leader_wait_s``), then answers 503.

A new leader's model may lag what the previous one wrote (its watch is milliseconds to seconds
behind). Until it has read every bound pod from the API after taking the Lease, its binds take the
locked path (fresh API state under the node lock), which rests on nothing in the model; from then on
its model holds every bind made before, and ``exclusive()`` lets binds decide from the model. What
the previous leader sent before its fence (``LeaderElector.is_leader``) has landed or timed out
before this replica's ``is_leader()`` became true, so that read covers it.

A leader decides only once its model holds the cluster (``ready``: its watches have listed). A cold
standby (``ExtenderSettings.cold_standby``) starts those watches when it first takes the Lease
(``before_leading``), so until its lists are in, the Lease holder answers 503 and kube-scheduler
retries.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import quote

import aiohttp

from hamipy.extender.model import ClusterModel
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import KubeApi
from hamipy.kube.errors import KubeError
from hamipy.kube.leader import LeaderElector
from hamipy.kube.resources import list_all, pod_path

__all__ = ["FORWARDED_HEADER", "LEADER_URL_ANNOTATION", "REDIRECTED_QUERY", "Forwarded", "Leadership"]

LEADER_URL_ANNOTATION: Final = "hami-py.io/extender-url"
"""Lease annotation: where the leader serves (its ``--advertise-url``)."""
FORWARDED_HEADER: Final = "X-Hamipy-Forwarded-By"
"""Set on a forwarded request (the forwarding replica's identity): a replica that is not the leader
refuses it instead of forwarding again, so a stale view never makes a loop."""
REDIRECTED_QUERY: Final = "hamipy-redirected-by"
"""Query parameter on a follower's redirect to the leader (the follower's identity), for the same
reason as ``FORWARDED_HEADER``."""
_RETRY_S: Final = 1.0
_BOUND: Final = (("fieldSelector", "spec.nodeName!="),)


class Forwarded:
    """A leader's answer to a forwarded request: its status and JSON body; or a redirect to the
    leader (status 307 and ``location``)."""

    def __init__(self, status: int, body: bytes, *, location: str | None = None) -> None:
        self.status = status
        self.body = body
        self.location = location


class Leadership:
    """This replica's role. Without ``election`` it is the only replica: it decides, and binds
    decide from the model. With it, the replica neither decides nor forwards until ``elector`` is
    set (``ExtenderServer.start``, once its URL is known)."""

    def __init__(
        self,
        *,
        election: bool,
        elector: LeaderElector | None = None,
        api: KubeApi,
        model: ClusterModel,
        telemetry: Telemetry,
        forward_ssl: ssl.SSLContext | None = None,
        forward_server_name: str | None = None,
        forward_timeout_s: float = 30.0,
        leader_wait_s: float = 5.0,
        api_timeout_s: float = 10.0,
        redirects: bool = False,
        ready: Callable[[], bool] = lambda: True,
        before_leading: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.election = election
        self.redirects = redirects
        """A follower answers a decision request with a 307 to the leader instead of forwarding it
        (``ExtenderSettings.follower_redirect``)."""
        self.elector = elector
        self.api = api
        self.model = model
        self.telemetry = telemetry
        self.forward_ssl = forward_ssl
        self.forward_server_name = forward_server_name
        self.forward_timeout_s = forward_timeout_s
        self.leader_wait_s = leader_wait_s
        self.api_timeout_s = api_timeout_s
        self._caught_up_term = -1
        """The Lease's ``leaseTransitions`` when this replica's model last caught up as its leader."""
        self.ready = ready
        """Whether the model holds the cluster (``Health.synced``): a leader decides only then."""
        self.before_leading = before_leading
        """Awaited each time this replica takes the Lease, before the catch-up: a cold standby
        starts its watches there (``ExtenderSettings.cold_standby``)."""
        self._session: aiohttp.ClientSession | None = None
        telemetry.metrics.leader.set_function(lambda: 1.0 if self.deciding() else 0.0)

    @property
    def identity(self) -> str:
        return self.elector.settings.identity if self.elector is not None else ""

    def deciding(self) -> bool:
        """Whether this replica answers decisions itself (the only replica, or the leader now)."""
        if not self.election:
            return True
        return self.elector is not None and self.elector.is_leader() and self.ready()

    def exclusive(self) -> bool:
        """Whether binds may decide from the model: this replica alone writes allocations now, and
        its model caught up after the Lease last changed hands (``leaseTransitions``): no other
        leader has written since."""
        if not self.election:
            return True
        if self.elector is None:
            return False
        leader = self.elector.leader
        return self.elector.is_leader() and leader is not None and leader.transitions == self._caught_up_term

    async def run(self) -> None:
        """Follow this replica's leadership: each time it takes the Lease, catch the model up before
        binds decide from it. Runs until cancelled (a supervised task)."""
        if self.elector is None:
            return
        while True:
            changed = self.elector.wait_changed()  # taken first: a change during catch-up wakes it
            try:
                if not self.elector.is_leader():
                    # A follower decides nothing: what it reserved as leader (a filter's choice, a
                    # Binding whose answer was lost) would hold GPUs in its model for no one.
                    dropped = self.model.drop_reservations()
                    if dropped:
                        self.telemetry.logger.info("not leading; reservations dropped", count=dropped)
                leader = self.elector.leader
                behind = leader is not None and leader.transitions != self._caught_up_term
                if self.elector.is_leader() and leader is not None and behind:
                    if self.before_leading is not None:
                        await self.before_leading()
                    await self._catch_up(leader.transitions)
                await changed
            finally:
                changed.close()  # not awaited when cancelled during catch-up

    async def _catch_up(self, term: int) -> None:
        """Take into the model every pod bound now, read from the API (a quorum read: it covers
        every write the previous leader made before its fence). The watch may deliver older
        versions of them later; a pod's older, unbound version changes no allocation."""
        while True:
            try:
                pods, version = await list_all(
                    self.api, pod_path(), query=_BOUND, timeout_s=self.api_timeout_s
                )
                break
            except KubeError as exc:
                self.telemetry.logger.warning("leader catch-up list failed; retrying", error=str(exc))
                await asyncio.sleep(_RETRY_S)
        for pod in pods:
            self.model.apply_pod("MODIFIED", pod)
        self._caught_up_term = term
        self.telemetry.logger.info(
            "leading; binds decide from the model",
            bound_pods=len(pods),
            resource_version=version,
            lease_transitions=term,
        )

    async def leader_url(self) -> tuple[str, str] | Forwarded:
        """The leader's identity and URL once one is known (waiting up to ``leader_wait_s``), or
        the 503 saying why there is none."""
        if self.elector is None:
            return _unavailable("this extender has not joined the leader election yet")
        leader = await self.elector.wait_leader(self.leader_wait_s)
        if leader is None:
            return _unavailable(f"no extender leader for {self.leader_wait_s:g}s")
        url = leader.annotations.get(LEADER_URL_ANNOTATION)
        if leader.identity == self.identity:
            return _unavailable(
                f"this extender ({self.identity}) holds the Lease but cannot decide yet "
                "(listing the cluster, or renewing the Lease)"
            )
        if not url:
            return _unavailable(f"extender leader {leader.identity} publishes no URL")
        return leader.identity, url.rstrip("/")

    async def redirect(self, path: str) -> Forwarded:
        """A 307 sending the caller to the leader (``--follower-redirect``), or a 503 saying why
        there is none. The target carries ``REDIRECTED_QUERY``: a replica that is not the leader
        refuses such a request rather than redirect it again."""
        found = await self.leader_url()
        if isinstance(found, Forwarded):
            return found
        _, url = found
        self.telemetry.metrics.forwarded.labels(verb=path.strip("/"), result="redirected").inc()
        location = f"{url}{path}?{REDIRECTED_QUERY}={quote(self.identity)}"
        return Forwarded(307, b"", location=location)

    async def forward(self, path: str, body: bytes) -> Forwarded:
        """Send a decision request to the leader; its answer, or a 503 saying why there is none."""
        found = await self.leader_url()
        if isinstance(found, Forwarded):
            return found
        identity, url = found
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.forward_timeout_s),
                connector=aiohttp.TCPConnector(ssl=self.forward_ssl or True),
            )
        try:
            async with self._session.post(
                url + path,
                data=body,
                headers={"Content-Type": "application/json", FORWARDED_HEADER: self.identity},
                server_hostname=self.forward_server_name,
            ) as resp:
                self.telemetry.metrics.forwarded.labels(verb=path.strip("/"), result="answered").inc()
                return Forwarded(resp.status, await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.telemetry.metrics.forwarded.labels(verb=path.strip("/"), result="failed").inc()
            return _unavailable(f"extender leader {identity} at {url} unreachable: {exc!r}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _unavailable(reason: str) -> Forwarded:
    return Forwarded(503, json.dumps({"Error": reason}).encode())
