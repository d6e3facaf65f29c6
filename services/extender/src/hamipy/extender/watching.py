"""List+watch of Nodes and Pods into the model, and the handshake stamping loop (the I/O feeding
``model``).

Per resource, four small steps (kopf's ``watching`` shape): an endless outer loop with jittered
backoff; a paginated list that replaces the model's view of that resource and marks it synced; a
watch from the list's resourceVersion (bookmarks on) that applies each event and advances the
resourceVersion on every event and bookmark, and is re-opened from there when the server ends it;
and a 410 Gone that ends the watch so the outer loop lists again. A silent stream is dropped after
``watch_inactivity_s`` (the socket read timeout).

Pods are watched in all namespaces: any pod may hold GPUs (bound by HAMi, by another replica, or
before a restart), and the allocation annotation is the only record of it.
"""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final, Literal

from hamipy.extender.errors import Gone, KubeError
from hamipy.extender.events import EventSink
from hamipy.extender.kube import KubeApi, list_all, patch_node
from hamipy.extender.model import ClusterModel, Problem
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.protocol import keys
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_handshake import needs_request, parse_handshake, requesting

__all__ = ["Resource", "Watcher", "report_problems", "stamp_handshakes"]

Resource = Literal["nodes", "pods"]
_PATHS: Final = {"nodes": "/api/v1/nodes", "pods": "/api/v1/pods"}
_FIRST_BACKOFF_S: Final = 0.5
_MAX_BACKOFF_S: Final = 30.0


def report_problems(problems: list[Problem], telemetry: Telemetry, events: EventSink) -> None:
    """Log, count and post an Event for each malformed object."""
    for p in problems:
        telemetry.metrics.malformed.labels(kind=p.kind, field=p.field.split("[", 1)[0]).inc()
        telemetry.logger.error(
            "malformed annotation; its capacity is not offered",
            kind=p.kind,
            namespace=p.namespace,
            name=p.name,
            uid=p.uid,
            field=p.field,
            error=p.reason,
        )
        involved = {"kind": p.kind, "name": p.name, "uid": p.uid}
        if p.namespace:
            involved["namespace"] = p.namespace
        events.emit(involved, "MalformedAnnotation", f"{p.reason}; its GPUs are not scheduled", warning=True)


class Watcher:
    """Keeps one resource of the model current."""

    def __init__(
        self,
        resource: Resource,
        *,
        api: KubeApi,
        model: ClusterModel,
        settings: ExtenderSettings,
        telemetry: Telemetry,
        events: EventSink,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.resource = resource
        self.api = api
        self.model = model
        self.settings = settings
        self.telemetry = telemetry
        self.events = events
        self.on_change = on_change
        self.resource_version = ""
        self.lists = 0

    def _apply_list(self, items: list[dict[str, Any]]) -> list[Problem]:
        if self.resource == "nodes":
            return self.model.replace_nodes(items)
        return self.model.replace_pods(items)

    def _apply(self, kind: Any, obj: dict[str, Any]) -> list[Problem]:
        if self.resource == "nodes":
            return self.model.apply_node(kind, obj)
        return self.model.apply_pod(kind, obj)

    async def run(self) -> None:
        """List and watch forever (until cancelled)."""
        backoff = _FIRST_BACKOFF_S
        while True:
            try:
                await self.list_once()
                backoff = _FIRST_BACKOFF_S
                while True:
                    await self.watch_once()
            except Gone:
                self.telemetry.metrics.watch_restarts.labels(resource=self.resource, cause="gone").inc()
                self.telemetry.logger.info("watch expired; listing again", resource=self.resource)
            except (KubeError, ValueError) as exc:
                self.telemetry.metrics.watch_restarts.labels(resource=self.resource, cause="error").inc()
                self.telemetry.logger.warning(
                    "list/watch failed; retrying", resource=self.resource, error=str(exc), backoff_s=backoff
                )
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def list_once(self) -> None:
        items, rv = await list_all(self.api, _PATHS[self.resource], timeout_s=self.settings.api_timeout_s * 3)
        report_problems(self._apply_list(items), self.telemetry, self.events)
        del items
        # The model is a large, long-lived heap (tens of thousands of pods): keep the cyclic GC from
        # walking it on every full collection, which otherwise shows as 100 ms filter pauses.
        gc.collect()
        gc.freeze()
        self.resource_version = rv
        self.lists += 1
        if self.on_change is not None:
            self.on_change()

    async def watch_once(self) -> None:
        """One watch from ``resource_version`` until the server closes it; raises ``Gone`` on 410."""
        query = [
            ("watch", "true"),
            ("resourceVersion", self.resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(int(self.settings.watch_timeout_s))),
        ]
        stream = self.api.stream(
            _PATHS[self.resource], query=query, inactivity_s=self.settings.watch_inactivity_s
        )
        async for event in stream:
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Gone(f"watch {self.resource}: {obj.get('message', 'resourceVersion too old')}")
                raise KubeError(
                    f"watch {self.resource}: {obj.get('message', obj)}", status=int(obj.get("code", 0))
                )
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                report_problems(self._apply(kind, obj), self.telemetry, self.events)
                if self.on_change is not None:
                    self.on_change()
            if rv:
                self.resource_version = str(rv)
        self.telemetry.metrics.watch_restarts.labels(resource=self.resource, cause="closed").inc()


async def stamp_handshakes(
    *,
    api: KubeApi,
    model: ClusterModel,
    settings: ExtenderSettings,
    telemetry: Telemetry,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> None:
    """Every ``handshake_interval_s``, write ``Requesting_<now>`` on registered nodes whose
    handshake is not a pending request (HAMi's scheduler does the same); a device plugin answers by
    registering again. Never on the filter path."""
    while True:
        await asyncio.sleep(settings.handshake_interval_s)
        await stamp_once(api=api, model=model, settings=settings, telemetry=telemetry, now=now())


async def stamp_once(
    *, api: KubeApi, model: ClusterModel, settings: ExtenderSettings, telemetry: Telemetry, now: datetime
) -> int:
    """One pass of ``stamp_handshakes``; returns how many nodes were stamped."""
    stamped = 0
    for node in list(model.nodes.values()):
        if not node.registered:
            continue
        try:
            handshake = parse_handshake(node.handshake) if node.handshake else None
        except ProtocolError:
            handshake = None
        if not needs_request(handshake):
            continue
        try:
            await patch_node(
                api,
                node.name,
                {keys.NODE_HANDSHAKE: requesting(now)},
                resource_version=None,
                timeout_s=settings.api_timeout_s,
            )
            stamped += 1
        except KubeError as exc:
            telemetry.logger.warning("handshake not stamped", node=node.name, error=str(exc))
    return stamped
