"""Fake API servers for the kube tests: ``ScriptedKube`` answers lists page by page from ``pages``
and replays watches from ``streams`` (an exception in a stream is raised there); ``EventStore``
keeps Events; ``Leases`` keeps Leases with resourceVersion preconditions, one ``LeaseClient`` per
replica. ``running_task`` runs a background coroutine for the length of a block."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from hamipy.kube.errors import Conflict, KubeError, NotFound


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


class Leases:
    """Leases kept as the API server keeps them, by path: every write gets a new resourceVersion; a
    PUT carrying another version, or a POST of one that exists, is ``Conflict``. ``intrude`` runs
    just before the next write lands, as another replica's write that got there first."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.intrude: Callable[[], object] | None = None
        self._version = 0

    def client(self) -> LeaseClient:
        return LeaseClient(self)

    def store(self, path: str, lease: dict[str, Any]) -> dict[str, Any]:
        """``lease`` written at ``path`` with the next resourceVersion, whatever was there."""
        self._version += 1
        stored = copy.deepcopy(lease)
        stored.setdefault("metadata", {})["resourceVersion"] = str(self._version)
        self.objects[path] = stored
        return copy.deepcopy(stored)

    def spec(self, path: str) -> dict[str, Any]:
        spec: dict[str, Any] = self.objects[path]["spec"]
        return spec

    def handle(self, method: str, path: str, body: Any) -> Any:
        self.calls.append((method, path))
        if method in ("POST", "PUT") and self.intrude is not None:
            intrude, self.intrude = self.intrude, None
            intrude()
        if method == "POST":
            path = f"{path}/{body['metadata']['name']}"
            if path in self.objects:
                raise Conflict(f"POST {path}: already exists", status=409)
            return self.store(path, body)
        current = self.objects.get(path)
        if current is None:
            raise NotFound(f"{method} {path}: not found", status=404)
        if method == "GET":
            return copy.deepcopy(current)
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise Conflict(f"PUT {path}: the object has been modified", status=409)
            return self.store(path, body)
        raise NotImplementedError(method)


class LeaseClient:
    """One replica's connection to ``Leases``: while ``down`` is set every call raises it; the next
    ``fail_next`` calls raise a ``KubeError``; while ``hang`` is set a call never answers."""

    def __init__(self, store: Leases) -> None:
        self.store = store
        self.down: KubeError | None = None
        self.fail_next = 0
        self.hang = False
        self.timeouts: list[float] = []

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
        self.timeouts.append(timeout_s)
        if self.hang:
            await asyncio.Event().wait()
        if self.down is not None:
            raise self.down
        if self.fail_next:
            self.fail_next -= 1
            raise KubeError(f"{method} {path}: HTTP 503: unavailable", status=503)
        return self.store.handle(method, path, copy.deepcopy(body))

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]], inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError


@contextlib.asynccontextmanager
async def running_task(coro: Coroutine[Any, Any, None], name: str) -> AsyncIterator[asyncio.Task[None]]:
    """``coro`` as a task while the block runs; cancelled and awaited after it."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
