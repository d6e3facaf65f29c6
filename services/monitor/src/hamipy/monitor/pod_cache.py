"""This node's pods, kept current by a list+watch, for scrapes and housekeeping to read without an
API call.

The watch loop has the usual four parts: an endless outer loop with jittered backoff; a list that
replaces the view and marks it synced; a watch from the list's resourceVersion (bookmarks on) that
applies each event, advances the resourceVersion and is re-opened from there when the server ends
it; and a 410 Gone that ends the watch so that the outer loop lists again.

``snapshot`` is an immutable mapping (pod UID -> ``PodRecord``) replaced as a whole on every change,
so a scrape running in a worker thread reads one consistent view without a lock. ``fresh`` is
False from a list or watch failure until the next successful list: the housekeeping pass removes
region directories of pods it does not know only while the view is fresh.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from hamipy.monitor.errors import Gone, KubeError
from hamipy.monitor.kube import PodsApi
from hamipy.monitor.pods import PodRecord, pod_record
from hamipy.monitor.telemetry import Telemetry

__all__ = ["PodCache"]

_FIRST_BACKOFF_S: Final = 0.2
_MAX_BACKOFF_S: Final = 10.0


class PodCache:
    """``snapshot``: this node's pods as last seen; ``run()`` keeps it current."""

    def __init__(
        self,
        api: PodsApi,
        telemetry: Telemetry,
        *,
        watch_timeout_s: int = 300,
        watch_inactivity_s: float = 330.0,
    ) -> None:
        self.api = api
        self.telemetry = telemetry
        self.watch_timeout_s = watch_timeout_s
        self.watch_inactivity_s = watch_inactivity_s
        self.synced = asyncio.Event()
        self.fresh = False
        self.snapshot: Mapping[str, PodRecord] = MappingProxyType({})
        self.resource_version = ""

    async def run(self) -> None:
        """List, then watch from the list's resourceVersion; forever (until cancelled)."""
        delay = _FIRST_BACKOFF_S
        while True:
            try:
                await self.list_once()
                delay = _FIRST_BACKOFF_S
                while True:
                    await self.watch_once()
                    self.telemetry.metrics.watch_restarts.labels(cause="closed").inc()
            except Gone as exc:
                self.fresh = False
                self.telemetry.metrics.watch_restarts.labels(cause="gone").inc()
                self.telemetry.log.info("pod watch expired; listing again", error=str(exc))
            except KubeError as exc:
                self.fresh = False
                self.telemetry.metrics.watch_restarts.labels(cause="error").inc()
                self.telemetry.log.warning("pod list/watch failed; retrying", error=str(exc), retry_s=delay)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, _MAX_BACKOFF_S)

    async def list_once(self) -> None:
        items, version = await self.api.list_pods()
        previous = self.snapshot
        fresh: dict[str, PodRecord] = {}
        for pod in items:
            record = self._record(pod, previous)
            fresh[record.uid] = record
        self.snapshot = MappingProxyType(fresh)
        self.resource_version = version
        self.fresh = True
        self.synced.set()

    async def watch_once(self) -> None:
        """Apply events until the server ends the watch; ``Gone`` on 410, ``KubeError`` on others."""
        async for event in self.api.watch_pods(
            self.resource_version, timeout_s=self.watch_timeout_s, inactivity_s=self.watch_inactivity_s
        ):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                message = obj.get("message", obj)
                if obj.get("code") == 410:
                    raise Gone(f"pod watch: {message}", status=410)
                raise KubeError(f"pod watch: {message}", status=int(obj.get("code") or 0))
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if kind in ("ADDED", "MODIFIED"):
                record = self._record(obj, self.snapshot)
                self.snapshot = MappingProxyType({**self.snapshot, record.uid: record})
            elif kind == "DELETED":
                uid = str((obj.get("metadata") or {}).get("uid", ""))
                self.snapshot = MappingProxyType({k: v for k, v in self.snapshot.items() if k != uid})
            if version:
                self.resource_version = str(version)

    def _record(self, pod: Mapping[str, Any], previous: Mapping[str, PodRecord]) -> PodRecord:
        """The pod's record; a malformed annotation is reported when first seen with that value."""
        record = pod_record(pod)
        error = record.allocation_error
        known = previous.get(record.uid)
        if error is not None and (known is None or known.annotation != record.annotation):
            self.telemetry.metrics.malformed.labels(field=error.field.split("[", 1)[0]).inc()
            self.telemetry.log.error(
                "malformed annotation; the pod's GPU limits are not reported",
                namespace=record.namespace,
                pod=record.name,
                uid=record.uid,
                field=error.field,
                error=str(error),
            )
        return record
