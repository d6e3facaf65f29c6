"""Leader election over a ``coordination.k8s.io/v1`` Lease, as client-go's ``leaderelection`` does it.

Replicas of a service share one Lease. The replica named in ``spec.holderIdentity`` leads and renews
the Lease every ``retry_period_s``; the others read it every ``retry_period_s`` (jittered as
client-go's ``wait.JitterUntil``, factor 1.2) and take it over once it has expired. Every write
carries the resourceVersion that was read (a PUT of the whole object; a POST only when there is no
Lease yet), so of two replicas racing for the Lease one wins and the other gets ``Conflict``.

Expiry is judged by local observation, never by the Lease's timestamps (two machines' clocks need
not agree): a replica notes on its own monotonic clock when it saw the Lease's record (holder,
duration, acquire and renew times, transitions) change, and may take another holder's Lease only
once that record has stood unchanged for longer than the ``leaseDurationSeconds`` it carries, or at
once when its holder is empty (released).

Fencing: ``is_leader()`` is true only while this replica holds the Lease and less than
``renew_deadline_s`` has passed since it *sent* its last successful renewal. A leader that cannot
renew stops acting before any other replica can see its Lease expire; ``run`` then steps it down
and goes back to trying to acquire.

What a caller can rest on: at any instant at most one replica's ``is_leader()`` is true, and what a
leader sent while it was true (with a timeout of at most ``api_timeout_s``) has landed or timed out
before another replica's becomes true. Another replica sees a renewal only after it was sent, then
waits ``lease_duration_s`` > ``renew_deadline_s`` + ``api_timeout_s`` (``LeaseSettings`` checks
this), so the clocks need no synchronisation, only rates that nearly agree. ``is_leader()`` is exact
at any instant; check it right before each leader-only action. ``wait_changed`` wakes when the loop
notices a change, which may come up to a round later than the instant ``is_leader()`` changed.

The identity must be unique per process (a pod name plus a random suffix, as client-go advises): a
replica that finds its own identity in the Lease renews it without waiting.

Usage: run ``run()`` as a supervised background task; on shutdown cancel it, then ``await
release()``, so that another replica takes over at once rather than after the lease duration
(client-go's ``ReleaseOnCancel``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Final

from hamipy.kube.client import KubeApi
from hamipy.kube.errors import Conflict, KubeError, NotFound
from hamipy.kube.informer import Logger
from hamipy.kube.resources import lease_path

__all__ = [
    "JITTER_FACTOR",
    "RELEASED_DURATION_S",
    "RELEASE_ATTEMPTS",
    "LeaderElector",
    "LeaderInfo",
    "LeaseSettings",
]

JITTER_FACTOR: Final = 1.2
"""client-go's: a replica not leading waits ``retry_period_s * (1 + 1.2 * random())`` between rounds."""
RELEASED_DURATION_S: Final = 1
"""``leaseDurationSeconds`` of a released Lease (client-go's); an empty holder is free at once anyway."""
RELEASE_ATTEMPTS: Final = 2
"""Releases that find the Lease written since it was last seen before giving up (it then expires)."""
_NO_ANNOTATIONS: Final[Mapping[str, str]] = MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseSettings:
    """Which Lease, who we are, and the election's timing (client-go's defaults, those of
    kube-scheduler and kube-controller-manager)."""

    namespace: str
    name: str
    identity: str
    """Unique per process: the Lease's holder names it."""
    lease_duration_s: float = 15.0
    """How long others wait, from when they last saw the Lease change, before taking it over
    (written rounded up to whole seconds)."""
    renew_deadline_s: float = 10.0
    """A leader that has not renewed for this long stops leading."""
    retry_period_s: float = 2.0
    """Between rounds: renewals while leading, attempts to acquire otherwise (jittered)."""
    api_timeout_s: float = 4.0
    """Per API call, here and in the caller's leader-only writes: 15 > 10 + 4 leaves a second for
    the clocks' rates to differ."""

    def __post_init__(self) -> None:
        for field in ("namespace", "name", "identity"):
            if not getattr(self, field):
                raise ValueError(f"LeaseSettings.{field} must not be empty")
        for field in ("lease_duration_s", "renew_deadline_s", "retry_period_s", "api_timeout_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"LeaseSettings.{field} must be positive, not {getattr(self, field)}")
        if not self.lease_duration_s > self.renew_deadline_s + self.api_timeout_s:
            raise ValueError(
                f"LeaseSettings: lease_duration_s ({self.lease_duration_s}) must exceed renew_deadline_s"
                f" ({self.renew_deadline_s}) + api_timeout_s ({self.api_timeout_s}), so that an old"
                " leader has stopped, its last writes included, before another can take the Lease"
            )
        if not self.renew_deadline_s > self.retry_period_s:
            raise ValueError(
                f"LeaseSettings: renew_deadline_s ({self.renew_deadline_s}) must exceed retry_period_s"
                f" ({self.retry_period_s}), so that a leader gets to retry a failed renewal"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderInfo:
    """The holder of the Lease as last observed."""

    identity: str
    annotations: Mapping[str, str]
    """The Lease's ``metadata.annotations`` (a leader publishes, say, its URL there)."""
    transitions: int
    """``spec.leaseTransitions``: how many times the holder has changed."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Record:
    """The Lease fields whose change restarts the expiry wait (client-go's ``LeaderElectionRecord``)."""

    holder: str
    duration_s: int
    acquire_time: str
    renew_time: str
    transitions: int


def _record_of(lease: Mapping[str, Any]) -> _Record:
    spec = lease.get("spec") or {}
    duration = spec.get("leaseDurationSeconds")
    transitions = spec.get("leaseTransitions")
    return _Record(
        holder=str(spec.get("holderIdentity") or ""),
        # client-go reads a missing duration as 0: such a Lease is free once seen.
        duration_s=duration if isinstance(duration, int) else 0,
        acquire_time=str(spec.get("acquireTime") or ""),
        renew_time=str(spec.get("renewTime") or ""),
        transitions=transitions if isinstance(transitions, int) else 0,
    )


def _annotations_of(lease: Mapping[str, Any]) -> dict[str, str]:
    annotations = (lease.get("metadata") or {}).get("annotations") or {}
    return {str(k): str(v) for k, v in annotations.items()}


def _micro_time(now: datetime) -> str:
    """A ``metav1.MicroTime``: RFC 3339 in UTC with microseconds."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _utc_now() -> datetime:
    return datetime.now(UTC)


class LeaderElector:
    """One replica's side of the election for ``settings.name`` (see the module docstring)."""

    def __init__(
        self,
        api: KubeApi,
        settings: LeaseSettings,
        *,
        logger: Logger,
        annotations: Mapping[str, str] = _NO_ANNOTATIONS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = _utc_now,
        random_fraction: Callable[[], float] = random.random,
    ) -> None:
        self.api = api
        self.settings = settings
        self.logger = logger
        self.annotations: Mapping[str, str] = MappingProxyType(dict(annotations))
        """Written into the Lease's annotations while this replica holds it (all of them: a former
        holder's never outlive its tenure)."""
        self._clock = clock
        self._wall_clock = wall_clock
        self._random = random_fraction
        self._path = lease_path(settings.namespace, settings.name)
        self._describe = f"{settings.namespace}/{settings.name}"
        self._lease: dict[str, Any] | None = None
        """The Lease as last read or written: the resourceVersion the next write is guarded by."""
        self._record: _Record | None = None
        self._observed_at = 0.0
        """``clock()`` when ``_record`` last changed."""
        self._leading = False
        self._renewed_at = 0.0
        """``clock()`` when the last successful acquire or renewal was sent."""
        self._lock = asyncio.Lock()
        """A round and ``release`` never interleave."""
        self._changed = asyncio.Event()
        self._published: tuple[bool, LeaderInfo | None] = (False, None)

    def is_leader(self) -> bool:
        """True while this replica holds the Lease and its last renewal was sent less than
        ``renew_deadline_s`` ago."""
        return self._leading and self._clock() < self._renewed_at + self.settings.renew_deadline_s

    @property
    def leader(self) -> LeaderInfo | None:
        """The observed holder: this replica while ``is_leader()``, another until its Lease expires
        by local observation; None when the Lease is free, unknown, expired, or ours but fenced."""
        record, lease = self._record, self._lease
        if record is None or lease is None or not record.holder:
            return None
        if record.holder == self.settings.identity:
            if not self.is_leader():
                return None
        elif self._expired(record):
            return None
        annotations = MappingProxyType(_annotations_of(lease))
        return LeaderInfo(identity=record.holder, annotations=annotations, transitions=record.transitions)

    def wait_changed(self) -> Coroutine[Any, Any, bool]:
        """Completes at the first change of ``is_leader()`` or ``leader`` that a round (or
        ``release``) notices after this call (not after the coroutine first runs)."""
        return self._changed.wait()

    async def wait_leader(self, timeout_s: float) -> LeaderInfo | None:
        """The leader, once there is one (this replica included); None after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                while (leader := self.leader) is None:
                    await self.wait_changed()
        except TimeoutError:
            return None
        return leader

    def next_delay_s(self) -> float:
        """How long ``run`` waits before the next round: ``retry_period_s`` while leading (but no
        later than the renew deadline), else that jittered."""
        period = self.settings.retry_period_s
        if self._leading:
            left = self._renewed_at + self.settings.renew_deadline_s - self._clock()
            return max(0.0, min(period, left))
        return period * (1.0 + JITTER_FACTOR * self._random())

    async def run(self) -> None:
        """Acquire, then renew, round after round, until cancelled; API errors are logged and the
        round retried. Call ``release()`` after cancelling it."""
        while True:
            await self._bounded_round()
            await asyncio.sleep(self.next_delay_s())

    async def _bounded_round(self) -> None:
        left = self._renewed_at + self.settings.renew_deadline_s - self._clock() if self._leading else 0.0
        if left <= 0:
            await self.try_acquire_or_renew()
            return
        # A renewal still under way at the deadline is abandoned, so the step-down is told at once.
        deadline = asyncio.timeout(left)
        try:
            async with deadline:
                await self.try_acquire_or_renew()
        except TimeoutError:
            if not deadline.expired():
                raise
            self._fence()
            self._publish()

    async def try_acquire_or_renew(self) -> bool:
        """One round: renew while leading, else read the Lease and take it if it is free or
        expired. API errors are logged, never raised. Returns ``is_leader()``."""
        async with self._lock:
            self._fence()
            self._publish()
            try:
                await self._round()
            except KubeError as exc:
                self.logger.warning(
                    "leader election round failed",
                    lease=self._describe,
                    error=str(exc),
                    leading=self._leading,
                )
            self._fence()
            self._publish()
        return self.is_leader()

    async def release(self) -> None:
        """Give the Lease up if this replica holds it (as last observed): write it with an empty
        holder, guarded by its resourceVersion, so that another replica takes it at once. A Lease
        written since it was last seen is read again and released if it still names this replica.
        Best effort: a failure is logged (the Lease then expires after its duration)."""
        async with self._lock:
            lease = self._lease
            if lease is None or _record_of(lease).holder != self.settings.identity:
                return
            self._leading = False
            self._publish()
            try:
                released = await self._release(lease)
            except KubeError as exc:
                released, error = False, str(exc)
            else:
                error = "the lease kept changing"
            if released:
                self.logger.info("released the lease", lease=self._describe, identity=self.settings.identity)
            elif self._record is not None and self._record.holder == self.settings.identity:
                self.logger.warning(
                    "could not release the lease; it expires after its duration",
                    lease=self._describe,
                    error=error,
                )
            self._publish()

    async def _release(self, lease: dict[str, Any]) -> bool:
        """True once released; False when another holds it meanwhile, or every attempt lost a race."""
        for _ in range(RELEASE_ATTEMPTS):
            try:
                written = await self._write("PUT", self._path, self._released(lease))
            except Conflict:
                # Written since we saw it (by a renewal of ours that timed out but landed, say).
                found = await self.api.request("GET", self._path, timeout_s=self.settings.api_timeout_s)
                lease = _checked(found, f"GET {self._path}")
                self._observe(lease, self._clock())
                if _record_of(lease).holder != self.settings.identity:
                    return False
                continue
            self._observe(written, self._clock())
            return True
        return False

    def _released(self, lease: Mapping[str, Any]) -> dict[str, Any]:
        """``lease`` with no holder and without our annotations (client-go's release)."""
        now = _micro_time(self._wall_clock())
        body = copy.deepcopy(dict(lease))
        body.setdefault("metadata", {})["annotations"] = {
            k: v for k, v in _annotations_of(lease).items() if k not in self.annotations
        }
        body["spec"] = {
            **(body.get("spec") or {}),
            "holderIdentity": "",
            "leaseDurationSeconds": RELEASED_DURATION_S,
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": _record_of(lease).transitions,
        }
        return body

    async def _round(self) -> None:
        identity = self.settings.identity
        if self._leading and self._lease is not None:
            # client-go's fast path: renew the Lease as last written, without reading it first.
            sent = self._clock()
            try:
                written = await self._write("PUT", self._path, self._claim(self._lease))
            except KubeError as exc:
                self.logger.info("renewal failed; reading the lease", lease=self._describe, error=str(exc))
            else:
                self._won(written, sent)
                return
        try:
            found = await self.api.request("GET", self._path, timeout_s=self.settings.api_timeout_s)
        except NotFound:
            await self._create()
            return
        lease = _checked(found, f"GET {self._path}")
        self._observe(lease, self._clock())
        record = _record_of(lease)
        if record.holder not in ("", identity) and not self._expired(record):
            return
        sent = self._clock()
        try:
            written = await self._write("PUT", self._path, self._claim(lease))
        except Conflict as exc:
            self.logger.info("lost a race for the lease", lease=self._describe, error=str(exc))
            return
        self._won(written, sent)

    async def _create(self) -> None:
        now = _micro_time(self._wall_clock())
        settings = self.settings
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": settings.name,
                "namespace": settings.namespace,
                "annotations": dict(self.annotations),
            },
            "spec": {
                "holderIdentity": settings.identity,
                "leaseDurationSeconds": math.ceil(settings.lease_duration_s),
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            },
        }
        sent = self._clock()
        try:
            created = await self._write("POST", lease_path(settings.namespace), body)
        except Conflict:
            # Another replica created it first: the next round reads it.
            self.logger.info("another replica created the lease first", lease=self._describe)
            return
        self._won(created, sent)

    def _claim(self, lease: Mapping[str, Any]) -> dict[str, Any]:
        """``lease`` held by this replica from now: renewed if it already was, else taken over."""
        record = _record_of(lease)
        now = _micro_time(self._wall_clock())
        ours = record.holder == self.settings.identity
        body = copy.deepcopy(dict(lease))
        body.setdefault("metadata", {})["annotations"] = dict(self.annotations)
        body["spec"] = {
            **(body.get("spec") or {}),
            "holderIdentity": self.settings.identity,
            "leaseDurationSeconds": math.ceil(self.settings.lease_duration_s),
            "acquireTime": record.acquire_time if ours and record.acquire_time else now,
            "renewTime": now,
            "leaseTransitions": record.transitions if ours else record.transitions + 1,
        }
        return body

    async def _write(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = await self.api.request(method, path, body=body, timeout_s=self.settings.api_timeout_s)
        return _checked(answer, f"{method} {path}")

    def _won(self, lease: dict[str, Any], sent: float) -> None:
        """Our write of ``lease``, sent at ``sent``, landed: we lead until ``sent`` + the deadline."""
        became = not self._leading
        self._leading = True
        self._renewed_at = sent
        self._observe(lease, sent)
        if became and self._leading:
            self.logger.info("became leader", lease=self._describe, identity=self.settings.identity)

    def _observe(self, lease: dict[str, Any], at: float) -> None:
        record = _record_of(lease)
        if record != self._record:
            self._record = record
            self._observed_at = at
        self._lease = lease
        if self._leading and record.holder != self.settings.identity:
            self._leading = False
            self.logger.warning(
                "another replica holds the lease; stepping down", lease=self._describe, holder=record.holder
            )

    def _expired(self, record: _Record) -> bool:
        return self._clock() > self._observed_at + record.duration_s

    def _fence(self) -> None:
        if self._leading and not self.is_leader():
            self._leading = False
            self.logger.warning(
                "lease not renewed within the renew deadline; stepping down",
                lease=self._describe,
                renew_deadline_s=self.settings.renew_deadline_s,
            )

    def _publish(self) -> None:
        state = (self.is_leader(), self.leader)
        if state != self._published:
            self._published = state
            self._changed.set()
            self._changed = asyncio.Event()


def _checked(answer: Any, what: str) -> dict[str, Any]:
    if not isinstance(answer, dict) or not isinstance(answer.get("metadata"), dict):
        raise KubeError(f"{what}: the answer is not a Lease: {str(answer)[:200]}")
    return answer
