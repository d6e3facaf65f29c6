"""Kubernetes Events, aggregated as client-go's recorder does, and written in the background so that
no request path waits for them.

One Event per involved object and reason (a *series*): the first occurrence is created at once;
each repeat raises the Event's ``count`` and ``lastTimestamp`` and takes its message, written back
at most once per ``update_interval_s`` per series. A pod the scheduler retries every few seconds
therefore has one ``FilteringFailed`` whose count rises, not one object per retry.

The Event's name is derived from the series (component, object, reason), so a restarted extender or
another replica finds the same object: a create answered 409 reads the count already there and adds
to it. Counts from replicas writing at the same moment may overwrite each other (as two client-go
recorders would); the object stays one. Series are kept for the ``cache_size`` most recent keys
(LRU; 4,096 as client-go); writes waiting are bounded by ``size`` (beyond it a write is dropped and
reported to ``on_drop`` with the reason ``queue-full``; a failed write with ``api-error``).

The Event calls themselves (``create_event``, ``patch_event``, ``get_event``) are here too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, Literal

from hamipy.kube.client import API_TIMEOUT_S, MERGE_PATCH, KubeApi
from hamipy.kube.errors import Conflict, KubeError, NotFound
from hamipy.kube.informer import Logger

__all__ = [
    "DropReason",
    "EventRecorder",
    "PendingEvent",
    "create_event",
    "get_event",
    "involved_pod",
    "patch_event",
]

DropReason = Literal["queue-full", "api-error"]

UPDATE_INTERVAL_S: Final = 10.0
"""Least time between two writes of one series: repeats in between only raise its count."""
CACHE_SIZE: Final = 4096
_NAME_PREFIX_MAX: Final = 200
"""An Event name is ``<object name>.<16 hex>``; names may be 253 characters."""


@dataclasses.dataclass(frozen=True, slots=True)
class PendingEvent:
    """One occurrence as emitted (``EventRecorder.recorded`` keeps the latest, for tests and logs)."""

    involved: Mapping[str, str]
    reason: str
    message: str
    warning: bool


@dataclasses.dataclass(slots=True)
class _Series:
    """One Event object: an involved object and a reason, with the occurrences seen here."""

    name: str
    namespace: str
    involved: dict[str, str]
    reason: str
    message: str
    warning: bool
    first: str
    last: str
    count: int = 0
    """Occurrences emitted by this process."""
    base: int = 0
    """Count already on the object when this process first wrote it (another writer's)."""
    created: bool = False
    queued: bool = False
    next_write_at: float = 0.0


def involved_pod(pod: Mapping[str, Any]) -> dict[str, str]:
    meta = pod.get("metadata") or {}
    return {
        "kind": "Pod",
        "name": str(meta.get("name", "")),
        "namespace": str(meta.get("namespace", "")),
        "uid": str(meta.get("uid", "")),
    }


def _timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _event_name(component: str, involved: Mapping[str, str], reason: str) -> str:
    identity = "/".join(
        (component, involved.get("kind", ""), involved.get("namespace", ""), involved.get("uid", ""))
    )
    digest = hashlib.sha256(f"{identity}/{involved.get('name', '')}/{reason}".encode()).hexdigest()[:16]
    return f"{involved.get('name', '')[:_NAME_PREFIX_MAX]}.{digest}"


class EventRecorder:
    """Aggregates the Events ``component`` reports and writes them; with ``NullKube`` it only
    records them. ``on_drop`` hears of each write not done (a metric)."""

    def __init__(
        self,
        api: KubeApi,
        *,
        component: str,
        logger: Logger,
        on_drop: Callable[[DropReason], None] | None = None,
        size: int = 1000,
        timeout_s: float = 5.0,
        update_interval_s: float = UPDATE_INTERVAL_S,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.api = api
        self.component = component
        self.logger = logger
        self.on_drop = on_drop
        self.size = size
        self.timeout_s = timeout_s
        self.update_interval_s = update_interval_s
        self.cache_size = cache_size
        self.recorded: collections.deque[PendingEvent] = collections.deque(maxlen=1000)
        self._series: collections.OrderedDict[tuple[str, ...], _Series] = collections.OrderedDict()
        self._due: list[tuple[float, int, tuple[str, ...]]] = []
        self._order = itertools.count()
        self._wake = asyncio.Event()

    def emit(self, involved: Mapping[str, str], reason: str, message: str, *, warning: bool = False) -> None:
        """Record one occurrence; never blocks and never calls the API."""
        self.recorded.append(PendingEvent(dict(involved), reason, message, warning))
        namespace = involved.get("namespace") or "default"
        key = (involved.get("kind", ""), namespace, involved.get("uid") or involved.get("name", ""), reason)
        series = self._series.get(key)
        now = _timestamp()
        if series is None:
            series = _Series(
                name=_event_name(self.component, involved, reason),
                namespace=namespace,
                involved=dict(involved),
                reason=reason,
                message=message,
                warning=warning,
                first=now,
                last=now,
            )
            self._series[key] = series
            if len(self._series) > self.cache_size:
                self._series.popitem(last=False)
        else:
            self._series.move_to_end(key)
        series.count += 1
        series.message, series.warning, series.last = message, warning, now
        if series.queued:
            return
        if len(self._due) >= self.size:
            self._dropped("queue-full")
            return
        series.queued = True
        due = max(time.monotonic(), series.next_write_at)
        heapq.heappush(self._due, (due, next(self._order), key))
        self._wake.set()

    def series_count(self, involved: Mapping[str, str], reason: str) -> int:
        """Occurrences of one series emitted by this process (0 when unknown)."""
        namespace = involved.get("namespace") or "default"
        key = (involved.get("kind", ""), namespace, involved.get("uid") or involved.get("name", ""), reason)
        series = self._series.get(key)
        return series.count if series is not None else 0

    async def run(self) -> None:
        """Write series as they fall due, until cancelled."""
        while True:
            if not self._due:
                self._wake.clear()
                await self._wake.wait()
                continue
            due, _, key = self._due[0]
            delay = due - time.monotonic()
            if delay > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                continue
            heapq.heappop(self._due)
            series = self._series.get(key)
            if series is None:  # evicted from the cache meanwhile
                continue
            series.queued = False
            series.next_write_at = time.monotonic() + self.update_interval_s
            try:
                await self._write(self.api, series)
            except KubeError as exc:
                self._dropped("api-error")
                self.logger.warning(
                    "event not written", reason=series.reason, name=series.name, error=str(exc)
                )

    def _dropped(self, reason: DropReason) -> None:
        if self.on_drop is not None:
            self.on_drop(reason)

    async def _write(self, api: KubeApi, series: _Series) -> None:
        if series.created:
            try:
                await self._patch(api, series)
                return
            except NotFound:  # expired (the API server keeps Events for an hour): start it again
                series.created, series.base = False, 0
        try:
            await self._create(api, series)
        except Conflict:  # another replica, or this extender before a restart, made it first
            existing = await get_event(api, series.namespace, series.name, timeout_s=self.timeout_s)
            series.base = int(existing.get("count") or 1)
            series.created = True
            await self._patch(api, series)

    async def _patch(self, api: KubeApi, series: _Series) -> None:
        await patch_event(
            api,
            series.namespace,
            series.name,
            count=series.base + series.count,
            last=series.last,
            message=series.message,
            timeout_s=self.timeout_s,
        )

    async def _create(self, api: KubeApi, series: _Series) -> None:
        await create_event(
            api,
            name=series.name,
            involved=series.involved,
            reason=series.reason,
            message=series.message,
            warning=series.warning,
            component=self.component,
            count=series.count,
            first=series.first,
            last=series.last,
            timeout_s=self.timeout_s,
        )
        series.created = True


def _event_path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/events"
    return f"{base}/{name}" if name else base


async def create_event(
    api: KubeApi,
    *,
    name: str,
    involved: Mapping[str, str],
    reason: str,
    message: str,
    warning: bool,
    component: str,
    count: int,
    first: str,
    last: str,
    timeout_s: float = API_TIMEOUT_S,
) -> None:
    """A core/v1 Event ``name`` about ``involved`` (kind, name, namespace, uid) seen ``count`` times
    between ``first`` and ``last`` (RFC 3339); nodes' go to ``default``. ``Conflict`` when it exists."""
    namespace = involved.get("namespace") or "default"
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", **involved},
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": first,
        "lastTimestamp": last,
        "count": count,
    }
    await api.request("POST", _event_path(namespace), body=body, timeout_s=timeout_s)


async def patch_event(
    api: KubeApi,
    namespace: str,
    name: str,
    *,
    count: int,
    last: str,
    message: str,
    timeout_s: float = API_TIMEOUT_S,
) -> None:
    """Raise an existing Event's count and last time, with the latest message (``NotFound`` when
    it expired)."""
    body = {"count": count, "lastTimestamp": last, "message": message[:1024]}
    await api.request(
        "PATCH", _event_path(namespace, name), body=body, content_type=MERGE_PATCH, timeout_s=timeout_s
    )


async def get_event(
    api: KubeApi, namespace: str, name: str, *, timeout_s: float = API_TIMEOUT_S
) -> dict[str, Any]:
    event: dict[str, Any] = await api.request("GET", _event_path(namespace, name), timeout_s=timeout_s)
    return event
