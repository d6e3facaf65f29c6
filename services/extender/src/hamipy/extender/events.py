"""Kubernetes Events, posted in the background so that no filter or bind waits for them.

``EventSink.emit`` only queues (bounded; a full queue drops the event and counts it); ``run`` posts
them one by one with a timeout each. Events about the same object and reason within a short
window are coalesced: a pod retried every second by the scheduler gets one FilteringFailed per
window, not hundreds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Final

from hamipy.extender.errors import KubeError
from hamipy.extender.kube import KubeApi, create_event
from hamipy.extender.telemetry import SERVICE_NAME, Telemetry

__all__ = ["EventSink", "PendingEvent", "involved_pod"]

_COALESCE_S: Final = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class PendingEvent:
    involved: Mapping[str, str]
    reason: str
    message: str
    warning: bool


def involved_pod(pod: Mapping[str, Any]) -> dict[str, str]:
    meta = pod.get("metadata") or {}
    return {
        "kind": "Pod",
        "name": str(meta.get("name", "")),
        "namespace": str(meta.get("namespace", "")),
        "uid": str(meta.get("uid", "")),
    }


class EventSink:
    """Queue of Events to post; ``api`` None only records them (unit tests, ``recorded``)."""

    def __init__(
        self, api: KubeApi | None, telemetry: Telemetry, *, size: int = 1000, timeout_s: float = 5.0
    ) -> None:
        self.api = api
        self.telemetry = telemetry
        self.timeout_s = timeout_s
        self.queue: asyncio.Queue[PendingEvent] = asyncio.Queue(maxsize=size)
        self.recorded: list[PendingEvent] = []
        self._recent: dict[tuple[str, str, str], float] = {}

    def emit(self, involved: Mapping[str, str], reason: str, message: str, *, warning: bool = False) -> None:
        key = (involved.get("uid", "") or involved.get("name", ""), reason, message)
        now = time.monotonic()
        last = self._recent.get(key)
        if last is not None and now - last < _COALESCE_S:
            return
        if len(self._recent) > 10_000:
            self._recent = {k: t for k, t in self._recent.items() if now - t < _COALESCE_S}
        self._recent[key] = now
        event = PendingEvent(dict(involved), reason, message, warning)
        self.recorded.append(event)
        if len(self.recorded) > 1000:
            del self.recorded[:500]
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.telemetry.metrics.events_dropped.labels(reason="queue-full").inc()

    async def run(self) -> None:
        """Post queued events until cancelled."""
        while True:
            event = await self.queue.get()
            if self.api is None:
                continue
            try:
                await create_event(
                    self.api,
                    involved=event.involved,
                    reason=event.reason,
                    message=event.message,
                    warning=event.warning,
                    component=SERVICE_NAME,
                    timeout_s=self.timeout_s,
                )
            except KubeError as exc:
                self.telemetry.metrics.events_dropped.labels(reason="api-error").inc()
                self.telemetry.logger.warning("event not posted", reason=event.reason, error=str(exc))
