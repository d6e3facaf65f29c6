"""One list+watch of a collection, kept current: the informer every service uses.

Four small steps, in the shape of kopf's ``watching``:

- ``run``: the endless outer loop; a failed list or watch (``KubeError``) is retried after a
  jittered, doubling backoff; a 410 Gone lists again at once. Anything else is a bug and ends
  ``run`` with its exception, for the service's supervisor to report (a watch must never die
  quietly behind a process that still says it is ready).
- ``list_once``: the collection page by page (``limit``/``continue``), then the whole set to the
  handlers (``listed``), the cache replaced (an object we wrote ourselves stays at its newer
  version), ``listed`` set (readiness) and ``fresh`` true.
- ``watch_once``: a watch from the list's resourceVersion with bookmarks, applying each event
  (``changed``) and advancing the resourceVersion on every event and bookmark, until the server
  ends it (re-opened from there by ``run``); a stream silent for ``inactivity_s`` is an error.
- a 410 in the stream raises ``Gone``, so ``run`` lists again.

The cache holds the objects by UID (``keep=False`` for a consumer that keeps its own model and
would only double the memory). ``remember`` applies an object the service wrote itself, so readers
see its own write before the watch delivers it; an older version never replaces a newer one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, Protocol

from hamipy.kube.client import KubeApi, Query
from hamipy.kube.errors import Gone, KubeError
from hamipy.kube.resources import LIST_PAGE, list_all

__all__ = [
    "ChangeKind",
    "Handler",
    "Informer",
    "InformerSettings",
    "Logger",
    "RestartCause",
    "object_uid",
]

ChangeKind = Literal["ADDED", "MODIFIED", "DELETED"]
RestartCause = Literal["gone", "error", "closed"]
_CHANGES: Final = frozenset({"ADDED", "MODIFIED", "DELETED"})


class Handler(Protocol):
    """What an informer tells: the whole collection after each list, then each change."""

    def listed(self, objects: list[dict[str, Any]]) -> None: ...

    def changed(self, kind: ChangeKind, obj: dict[str, Any]) -> None: ...


class Logger(Protocol):
    """A structlog-style logger (event text and keyword fields)."""

    def info(self, event: str, **fields: Any) -> Any: ...

    def warning(self, event: str, **fields: Any) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class InformerSettings:
    """How one informer lists, watches and backs off."""

    page_size: int = LIST_PAGE
    """Items per list page."""
    list_timeout_s: float = 30.0
    """Per list page: a page of 500 large pods takes well under a second."""
    watch_timeout_s: int = 300
    """The server ends each watch after this (``timeoutSeconds``); it is re-opened from its
    resourceVersion, which keeps long-lived connections from going stale behind proxies."""
    inactivity_s: float = 330.0
    """A watch with no event, bookmark or end for this long is dropped (bookmarks come every
    minute; the server's own end comes at ``watch_timeout_s``)."""
    first_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    """Jittered to 0.5-1.5x: a watch is back at most 15 s after the API server answers again (a
    handful of watches per process; client-go's reflector waits up to 30 s)."""


def object_uid(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    return str(metadata.get("uid", "")) if isinstance(metadata, Mapping) else ""


def _version(obj: Mapping[str, Any]) -> int:
    metadata = obj.get("metadata")
    text = str(metadata.get("resourceVersion", "")) if isinstance(metadata, Mapping) else ""
    return int(text) if text.isdigit() else -1


class Informer:
    """Keeps one collection (``path``, narrowed by ``query`` selectors) current for its handlers."""

    def __init__(
        self,
        api: KubeApi,
        path: str,
        *,
        logger: Logger,
        query: Query = (),
        settings: InformerSettings = InformerSettings(),
        keep: bool = True,
        on_restart: Callable[[RestartCause], None] | None = None,
        random_fraction: Callable[[], float] = random.random,
    ) -> None:
        self.api = api
        self.path = path
        self.logger = logger
        self.query = tuple(query)
        self.settings = settings
        self.keep = keep
        self.on_restart = on_restart
        self._random = random_fraction
        self.handlers: list[Handler] = []
        self.cache: dict[str, dict[str, Any]] = {}
        self.listed = asyncio.Event()
        """Set after the first complete list: the service may answer from what it was told."""
        self.fresh = False
        """True from a successful list until the next failure: whether ``cache`` is current."""
        self.resource_version = ""
        self.lists = 0

    def subscribe(self, handler: Handler) -> None:
        self.handlers.append(handler)

    def remember(self, obj: dict[str, Any]) -> None:
        """An object as the API returned it to our own write: into the cache unless the cache has
        a newer version, and to the handlers as a change."""
        self._apply("MODIFIED", obj)

    async def run(self) -> None:
        """List and watch forever (until cancelled, or a bug raises)."""
        backoff = self.settings.first_backoff_s
        while True:
            try:
                await self.list_once()
                backoff = self.settings.first_backoff_s
                while True:
                    await self.watch_once()
                    self._restarted("closed")
            except Gone as exc:
                self.fresh = False
                self._restarted("gone")
                self.logger.info("watch expired; listing again", path=self.path, error=str(exc))
            except KubeError as exc:
                self.fresh = False
                self._restarted("error")
                delay = backoff * (0.5 + self._random())
                self.logger.warning(
                    "list/watch failed; retrying", path=self.path, error=str(exc), retry_s=round(delay, 3)
                )
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, self.settings.max_backoff_s)

    def _restarted(self, cause: RestartCause) -> None:
        if self.on_restart is not None:
            self.on_restart(cause)

    async def list_once(self) -> None:
        items, version = await list_all(
            self.api,
            self.path,
            query=self.query,
            timeout_s=self.settings.list_timeout_s,
            page=self.settings.page_size,
        )
        if self.keep:
            # A list answered before our own write landed must not undo it (``remember``).
            items = [self._newest(obj) for obj in items]
            self.cache = {object_uid(obj): obj for obj in items}
        for handler in self.handlers:
            handler.listed(items)
        self.resource_version = version
        self.lists += 1
        self.fresh = True
        self.listed.set()

    async def watch_once(self) -> None:
        """One watch from ``resource_version`` until the server ends it; ``Gone`` on a 410."""
        query = [
            *self.query,
            ("watch", "true"),
            ("resourceVersion", self.resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(self.settings.watch_timeout_s)),
        ]
        async for event in self.api.stream(self.path, query=query, inactivity_s=self.settings.inactivity_s):
            if not isinstance(event, dict):
                raise KubeError(f"WATCH {self.path}: a line that is not an event: {str(event)[:200]}")
            kind = event.get("type")
            obj = event.get("object")
            if not isinstance(obj, dict):
                raise KubeError(f"WATCH {self.path}: an event without an object: {str(event)[:200]}")
            if kind == "ERROR":
                message = f"WATCH {self.path}: {obj.get('message', obj)}"
                code = obj.get("code")
                raise (Gone if code == 410 else KubeError)(
                    message, status=code if isinstance(code, int) else 0
                )
            if kind in _CHANGES:
                self._apply(kind, obj)
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:  # events and bookmarks alike advance it
                self.resource_version = str(version)

    def _newest(self, obj: dict[str, Any]) -> dict[str, Any]:
        known = self.cache.get(object_uid(obj))
        return known if known is not None and _version(known) > _version(obj) else obj

    def _apply(self, kind: ChangeKind, obj: dict[str, Any]) -> None:
        if self.keep:
            uid = object_uid(obj)
            if kind == "DELETED":
                self.cache.pop(uid, None)
            else:
                known = self.cache.get(uid)
                if known is not None and _version(known) > _version(obj):
                    return  # our own newer write is in already (``remember``)
                self.cache[uid] = obj
        for handler in self.handlers:
            handler.changed(kind, obj)
