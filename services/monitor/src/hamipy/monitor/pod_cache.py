"""This node's pods, kept current by the shared informer, for scrapes and housekeeping to read
without an API call.

The list+watch is ``hamipy.kube.informer.Informer`` over ``spec.nodeName=<node>`` (paged list,
watch with bookmarks, re-list on 410 Gone, jittered backoff on API errors; anything else ends it,
for the monitor's supervisor to report). It keeps no cache of its own (``keep=False``): ``PodCache``
is its handler and keeps each pod reduced to a ``PodRecord``.

``snapshot`` is an immutable mapping (pod UID -> ``PodRecord``) replaced as a whole on every change,
so a scrape running in a worker thread reads one consistent view without a lock. ``fresh`` is the
informer's: False from a list or watch failure until the next successful list; the housekeeping
pass removes region directories of pods it does not know only while the view is fresh. Restarts
of the list+watch are counted by cause in ``hamipy_monitor_watch_restarts_total``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from hamipy.kube.client import KubeApi
from hamipy.kube.informer import ChangeKind, Informer, InformerSettings, RestartCause, object_uid
from hamipy.kube.resources import node_pods_query, pod_path
from hamipy.monitor.pods import PodRecord, pod_record
from hamipy.monitor.telemetry import Telemetry
from hamipy.protocol import keys

__all__ = ["PODS_PATH", "PodCache"]

PODS_PATH: Final = pod_path()
"""Pods of every namespace: narrowed to one node by ``node_pods_query``."""


class PodCache:
    """``snapshot``: this node's pods as last seen; ``run()`` keeps it current."""

    def __init__(
        self, api: KubeApi, telemetry: Telemetry, *, node_name: str, settings: InformerSettings
    ) -> None:
        self.telemetry = telemetry
        self.logger = telemetry.logger.bind(node=node_name)
        self.snapshot: Mapping[str, PodRecord] = MappingProxyType({})
        self.informer = Informer(
            api,
            PODS_PATH,
            logger=self.logger,
            query=node_pods_query(node_name),
            settings=settings,
            keep=False,
            on_restart=self._restarted,
        )
        self.informer.subscribe(self)

    @property
    def synced(self) -> asyncio.Event:
        """Set after the first complete list."""
        return self.informer.listed

    @property
    def fresh(self) -> bool:
        """Whether the view is complete: listed, and no failure since."""
        return self.informer.fresh

    @property
    def resource_version(self) -> str:
        return self.informer.resource_version

    async def run(self) -> None:
        """The informer's list+watch, forever (``KubeError`` retried; anything else raised)."""
        await self.informer.run()

    # --- the informer's handler ---

    def listed(self, objects: list[dict[str, Any]]) -> None:
        previous = self.snapshot
        fresh: dict[str, PodRecord] = {}
        for pod in objects:
            record = self._record(pod, previous)
            fresh[record.uid] = record
        self.snapshot = MappingProxyType(fresh)

    def changed(self, kind: ChangeKind, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            uid = object_uid(obj)
            self.snapshot = MappingProxyType({k: v for k, v in self.snapshot.items() if k != uid})
        else:
            record = self._record(obj, self.snapshot)
            self.snapshot = MappingProxyType({**self.snapshot, record.uid: record})

    def _restarted(self, cause: RestartCause) -> None:
        self.telemetry.metrics.watch_restarts.labels(cause=cause).inc()

    def _record(self, pod: Mapping[str, Any], previous: Mapping[str, PodRecord]) -> PodRecord:
        """The pod's record; a malformed annotation is reported when first seen with that value."""
        record = pod_record(pod)
        known = previous.get(record.uid)
        checks = (
            (
                keys.DEVICES_ALLOCATED,
                record.allocation_error,
                record.annotation,
                None if known is None else known.annotation,
                "malformed annotation; the pod's GPU limits are not reported",
            ),
            (
                keys.MIG_ALLOCATIONS,
                record.mig_allocation_error,
                record.mig_annotation,
                None if known is None else known.mig_annotation,
                "malformed annotation; the pod's MIG instances are not reported",
            ),
        )
        for field, error, value, before, message in checks:
            if error is not None and (known is None or before != value):
                self.telemetry.metrics.malformed.labels(field=field).inc()
                self.logger.error(
                    message,
                    namespace=record.namespace,
                    pod=record.name,
                    uid=record.uid,
                    field=error.field,
                    error=str(error),
                )
        return record
