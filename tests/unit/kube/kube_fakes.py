"""A scripted API server for the informer's and the recorder's tests: lists answered page by page
from ``pages``, watches replayed from ``streams`` (an exception in a stream is raised there)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from hamipy.kube.errors import KubeError


def obj(uid: str, version: int, **labels: str) -> dict[str, Any]:
    return {"metadata": {"uid": uid, "name": uid, "resourceVersion": str(version), "labels": labels}}


def event(kind: str, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": item}


def bookmark(version: int) -> dict[str, Any]:
    return {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": str(version)}}}


def gone() -> dict[str, Any]:
    return {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}


class ScriptedKube:
    """Each list is a sequence of pages ``(items, continue, resourceVersion)``; each watch a
    sequence of events or exceptions. When the script runs out, a watch waits forever."""

    def __init__(self) -> None:
        self.lists: list[Sequence[tuple[list[dict[str, Any]], str, str]] | Exception] = []
        self.streams: list[Sequence[dict[str, Any] | BaseException]] = []
        self.calls: list[tuple[str, str, dict[str, str]]] = []
        self.watches: list[dict[str, str]] = []
        self._page = 0

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str = "application/json",
        timeout_s: float = 10.0,
    ) -> Any:
        q = dict(query)
        self.calls.append((method, path, q))
        if not self.lists:
            raise KubeError(f"{method} {path}: nothing scripted", status=503)
        current = self.lists[0]
        if isinstance(current, Exception):
            self.lists.pop(0)
            raise current
        items, token, version = current[self._page]
        self._page += 1
        if not token:
            self.lists.pop(0)
            self._page = 0
        return {"items": items, "metadata": {"continue": token, "resourceVersion": version}}

    async def stream(
        self, path: str, *, query: Sequence[tuple[str, str]], inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        self.watches.append(dict(query))
        if not self.streams:
            await asyncio.Event().wait()  # an open, quiet watch
        for item in self.streams.pop(0):
            if isinstance(item, BaseException):
                raise item
            yield item


class EventStore:
    """Events kept as the API server keeps them: by namespace and name (``events`` is the live list);
    ``fail`` maps (method, path) to an error raised instead."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[tuple[str, str], KubeError] = {}

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str = "application/json",
        timeout_s: float = 10.0,
    ) -> Any:
        from hamipy.kube.errors import Conflict, NotFound

        self.calls.append((method, path))
        if (method, path) in self.fail:
            raise self.fail[(method, path)]
        parts = path.strip("/").split("/")  # api v1 namespaces <ns> events [name]
        namespace, name = parts[3], parts[5] if len(parts) == 6 else ""
        if method == "POST":
            name = body["metadata"]["name"]
        found = [
            e for e in self.events if (e["metadata"]["namespace"], e["metadata"]["name"]) == (namespace, name)
        ]
        if method == "POST":
            if found:
                raise Conflict(f"event {namespace}/{name} already exists", status=409)
            self.events.append(dict(body))
            return body
        if not found:
            raise NotFound(path, status=404)
        if method == "PATCH":
            found[0].update(body)
        return dict(found[0])

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]], inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError
