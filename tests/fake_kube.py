"""An in-memory Kubernetes API server for the unit tests, behind ``hamipy.kube.client.KubeApi``.

``FakeKube`` keeps objects by path, as the API server does, and answers what the services send:
GET of an object or a collection (label and field selectors of equality, ``limit``/``continue``
pages, the list's resourceVersion), POST (create, or a pod's ``binding``), PUT, PATCH (merge and
strategic merge as a JSON merge patch, JSON patch with ``test``), DELETE. Every write gets the next
resourceVersion, and the API server's preconditions hold: a stale ``resourceVersion`` or another
``uid`` in a PUT, a patch, a Binding or a delete's preconditions is a ``Conflict``, as is creating
what exists or binding a bound pod. Stricter than the API server, a PUT without the
resourceVersion it replaces is a ``Conflict`` too: every replace the services make is guarded.
Errors are the real client's (``error_for``).

A test sees and changes the server's side without a request: ``add``, ``write`` and ``remove`` are
another client's writes (a new resourceVersion, no log, no hook), ``get``/``pod``/``node``/``items``
the stored objects themselves (live: read them after the code under test ran). ``requests`` logs
every call. ``fail`` makes calls fail, ``race`` lets another writer in before a write, and
``on_request`` sees each call first (to hold it, fail it or change the objects under it); ``send``
scripts the watches of a path; ``connect`` is a second client of the same server (another replica)
with failures of its own. ``ServedKube`` answers over HTTP from a ``FakeKube``, for a service run
as its own process.

Any test imports it as ``fake_kube`` (``tests/`` is on ``sys.path``, as for ``builders``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import fnmatch
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

from aiohttp import web

from hamipy.kube.client import API_TIMEOUT_S, JSON, JSON_PATCH, Query
from hamipy.kube.errors import KubeError, error_for

__all__ = [
    "FIRST_VERSION",
    "FakeKube",
    "Request",
    "RequestHook",
    "ServedKube",
    "WatchStep",
    "bookmark",
    "gone",
    "path_of",
    "watch_event",
]

FIRST_VERSION: Final = 100
"""The first resourceVersion the server gives: above the ones builders write (``"1"``), so a
stored object never carries the version of the unstored one it was made from."""

RequestHook = Callable[[str, str, Any], Awaitable[None] | None]
"""Called with (method, path, body) as each request arrives, before it is answered: it may change
the stored objects (another writer got there first), raise (this request fails) or, as a
coroutine, hold the request until the test lets it go."""

WatchStep = dict[str, Any] | BaseException | asyncio.Event | None
"""One step of a watch: an event sent, an exception raised in the stream, a pause until the test
sets the ``asyncio.Event``, or ``None``: the server ends the watch."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One call as it arrived (``method`` ``WATCH`` for a watch, its inactivity limit as
    ``timeout_s``)."""

    method: str
    path: str
    query: dict[str, str]
    body: Any
    content_type: str
    timeout_s: float


@dataclasses.dataclass
class _Failure:
    error: BaseException
    method: str
    path: str
    times: int | None


class _Ref(NamedTuple):
    """A path taken apart: ``/api/v1/namespaces/ns/pods/p/binding`` is (``/api/v1``, ``ns``,
    ``pods``, ``p``, ``binding``); a collection has no name, a cluster-wide one no namespace."""

    group: str
    namespace: str
    resource: str
    name: str
    sub: str

    @property
    def object_path(self) -> str:
        where = f"/namespaces/{self.namespace}" if self.namespace else ""
        return f"{self.group}{where}/{self.resource}/{self.name}"


def _parse(path: str) -> _Ref:
    parts = path.strip("/").split("/")
    cut = 2 if parts[0] == "api" else 3
    group, rest = "/" + "/".join(parts[:cut]), parts[cut:]
    namespace = ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or parts[0] not in ("api", "apis"):
        raise error_for(404, path, "not a resource path")
    name, sub = [*rest[1:3], "", ""][:2]
    return _Ref(group, namespace, rest[0], name, sub)


def path_of(obj: Mapping[str, Any]) -> str:
    """Where the API server keeps ``obj``: from its apiVersion, kind (plural: lower case and an
    ``s``, as for every kind stored here), namespace and name."""
    version, meta = obj["apiVersion"], obj["metadata"]
    group = f"/api/{version}" if "/" not in version else f"/apis/{version}"
    where = f"/namespaces/{meta['namespace']}" if meta.get("namespace") else ""
    return f"{group}{where}/{obj['kind'].lower()}s/{meta['name']}"


def _merge_patch(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386 onto ``target`` in place: ``None`` removes a key, maps merge, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping):
            inner = target.get(key)
            if not isinstance(inner, dict):
                inner = target[key] = {}
            _merge_patch(inner, value)
        else:
            target[key] = copy.deepcopy(value)


def _json_patch(target: dict[str, Any], ops: Iterable[Mapping[str, Any]], what: str) -> dict[str, Any]:
    """RFC 6902's ``test``, ``add``, ``replace`` and ``remove`` on a copy of ``target``; a failed
    ``test`` is the API server's 422."""
    out = copy.deepcopy(target)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        holder: Any = out
        for part in parents:
            holder = holder[int(part)] if isinstance(holder, list) else holder[part]
        key: Any = int(last) if isinstance(holder, list) and last != "-" else last
        if op["op"] == "test":
            if holder[key] != op["value"]:
                raise error_for(422, what, f"the test of {op['path']} failed")
        elif op["op"] == "remove":
            del holder[key]
        elif op["op"] == "add" and isinstance(holder, list):
            holder.insert(len(holder) if key == "-" else key, copy.deepcopy(op["value"]))
        elif op["op"] in ("add", "replace"):
            holder[key] = copy.deepcopy(op["value"])
        else:
            raise error_for(422, what, f"unsupported operation {op['op']}")
    return out


def _field(obj: Mapping[str, Any], dotted: str) -> str:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def _selected(obj: Mapping[str, Any], query: Mapping[str, str]) -> bool:
    """Whether ``obj`` passes the query's field and label selectors (``k=v``, ``k==v``, ``k!=v``)."""
    labels = obj["metadata"].get("labels") or {}
    value_of: dict[str, Callable[[str], str]] = {
        "fieldSelector": lambda key: _field(obj, key),
        "labelSelector": lambda key: str(labels.get(key, "")),
    }
    for selector, value in value_of.items():
        for term in filter(None, query.get(selector, "").split(",")):
            negated = "!=" in term
            key, _, want = term.partition("!=" if negated else "=")
            if (value(key) == want.lstrip("=")) == negated:
                return False
    return True


def watch_event(kind: str, obj: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


def bookmark(version: int) -> dict[str, Any]:
    return {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": str(version)}}}


def gone() -> dict[str, Any]:
    """The watch event of an expired resourceVersion (HTTP 410 in the stream)."""
    return {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}


class _Server:
    """What every client of one API server shares."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.requests: list[Request] = []
        self.watches: list[Request] = []
        self.feeds: dict[str, asyncio.Queue[WatchStep]] = {}
        self.version = FIRST_VERSION - 1
        """The latest resourceVersion given."""

    def stamp(self, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"].setdefault("uid", f"uid-{self.version}")


class FakeKube:
    """One client of an in-memory API server (see the module's docstring)."""

    def __init__(self, *objects: Mapping[str, Any], server: _Server | None = None) -> None:
        self._server = server or _Server()
        self.failures: list[_Failure] = []
        self.races: dict[str, tuple[dict[str, Any], int]] = {}
        self.on_request: RequestHook | None = None
        self.add(*objects)

    def connect(self) -> FakeKube:
        """Another client of the same server: the same objects and log, its own failures and hook."""
        return FakeKube(server=self._server)

    # -- the server's side, as a test sees it ------------------------------------------------------

    @property
    def objects(self) -> dict[str, dict[str, Any]]:
        """Every stored object by path."""
        return self._server.objects

    @property
    def requests(self) -> list[Request]:
        """Every call of every client, in order."""
        return self._server.requests

    @property
    def calls(self) -> list[tuple[str, str]]:
        """``requests`` as (method, path)."""
        return [(r.method, r.path) for r in self._server.requests]

    @property
    def watches(self) -> list[Request]:
        """Every watch opened, in order."""
        return self._server.watches

    def add(self, *objects: Mapping[str, Any]) -> None:
        """Store each object at its path (``path_of``), replacing what is there, as another client
        writes it: the next resourceVersion, and a uid when it has none."""
        for obj in objects:
            stored = copy.deepcopy(dict(obj))
            self._server.stamp(stored)
            current = self.objects.setdefault(path_of(stored), stored)
            if current is not stored:  # a reference a test holds sees the new content
                current.clear()
                current.update(stored)

    def get(self, path: str) -> dict[str, Any]:
        """The object stored at ``path`` itself (``KeyError`` when there is none)."""
        return self.objects[path]

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[f"/api/v1/namespaces/{namespace}/pods/{name}"]

    def node(self, name: str) -> dict[str, Any]:
        return self.objects[f"/api/v1/nodes/{name}"]

    def items(self, collection: str, query: Query = ()) -> list[dict[str, Any]]:
        """The stored objects of ``collection`` (every namespace's, for a cluster-wide path) that
        the selectors in ``query`` select, in the order a list answers them."""
        return [self.objects[path] for path in self._paths(collection, dict(query))]

    def _paths(self, collection: str, query: Mapping[str, str]) -> list[str]:
        ref = _parse(collection)
        return [
            path
            for path, got in sorted((path, _parse(path)) for path in self.objects)
            if (got.group, got.resource) == (ref.group, ref.resource)
            and ref.namespace in ("", got.namespace)
            and _selected(self.objects[path], query)
        ]

    def write(self, path: str, patch: Mapping[str, Any]) -> None:
        """Another writer merge-patches the object at ``path``: a new resourceVersion."""
        _merge_patch(self.objects[path], patch)
        self._server.stamp(self.objects[path])

    def remove(self, path: str) -> None:
        """Another client deletes the object at ``path``."""
        del self.objects[path]

    def send(self, path: str, *steps: WatchStep) -> None:
        """Queue ``steps`` for the watches of ``path``, read in order by whichever watch is open;
        with nothing queued a watch stays open and quiet."""
        feed = self._server.feeds.setdefault(path, asyncio.Queue())
        for step in steps:
            feed.put_nowait(step)

    def fail(
        self, error: BaseException, method: str = "*", path: str = "*", *, times: int | None = None
    ) -> None:
        """This client's calls matching ``method`` and ``path`` (``fnmatch`` patterns) raise
        ``error``: the next ``times`` of them, or every one until ``heal``."""
        self.failures.append(_Failure(error, method, path, times))

    def race(self, path: str, patch: Mapping[str, Any] | None = None, *, times: int = 1) -> None:
        """Before each of this client's next ``times`` writes to ``path``, another writer's merge
        ``patch`` lands there: a new resourceVersion, so a write guarded by the one read loses."""
        self.races[path] = (dict(patch or {}), times)

    def heal(self) -> None:
        """No more injected failures."""
        self.failures.clear()

    # -- KubeApi ---------------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Query = (),
        body: Any = None,
        content_type: str = JSON,
        timeout_s: float = API_TIMEOUT_S,
    ) -> Any:
        self.requests.append(Request(method, path, dict(query), copy.deepcopy(body), content_type, timeout_s))
        if self.on_request is not None:
            held = self.on_request(method, path, body)
            if inspect.isawaitable(held):
                await held
        self._raced(method, path)
        self._injected(method, path)
        return copy.deepcopy(self._answer(method, path, dict(query), copy.deepcopy(body), content_type))

    async def stream(self, path: str, *, query: Query, inactivity_s: float) -> AsyncIterator[dict[str, Any]]:
        self.watches.append(Request("WATCH", path, dict(query), None, "", inactivity_s))
        self._injected("WATCH", path)
        feed = self._server.feeds.setdefault(path, asyncio.Queue())
        while True:
            step = await feed.get()
            if step is None:
                return
            if isinstance(step, BaseException):
                raise step
            if isinstance(step, asyncio.Event):
                await step.wait()
                continue
            yield copy.deepcopy(step)

    # -- answering -------------------------------------------------------------------------------

    def _raced(self, method: str, path: str) -> None:
        if method == "GET" or path not in self.races:
            return
        patch, left = self.races.pop(path)
        if left > 1:
            self.races[path] = (patch, left - 1)
        self.write(path, patch)

    def _injected(self, method: str, path: str) -> None:
        for failure in self.failures:
            if fnmatch.fnmatchcase(method, failure.method) and fnmatch.fnmatchcase(path, failure.path):
                if failure.times is not None:
                    failure.times -= 1
                    if failure.times == 0:
                        self.failures.remove(failure)
                raise failure.error

    def _answer(self, method: str, path: str, query: dict[str, str], body: Any, content_type: str) -> Any:
        what = f"{method} {path}"
        ref = _parse(path)
        if not ref.name and method == "GET":
            return self._list(path, query)
        if not ref.name and method == "POST":
            return self._create(ref, body, what)
        obj = self.objects.get(ref.object_path)
        if obj is None:
            raise error_for(404, what, f'{ref.resource} "{ref.name}" not found')
        if ref.sub == "binding" and method == "POST":
            return self._bind(obj, body, what)
        if ref.sub not in ("", "status"):
            raise error_for(404, what, f"no subresource {ref.sub}")
        if method == "GET":
            return obj
        if method == "DELETE":
            self._check(obj, (body or {}).get("preconditions") or {}, what)
            del self.objects[ref.object_path]
            return {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if method == "PUT":
            if not body["metadata"].get("resourceVersion"):
                raise error_for(409, what, "a PUT here must carry the resourceVersion it replaces")
            self._check(obj, body["metadata"], what)
            return self._replace(obj, body)
        if method == "PATCH" and content_type == JSON_PATCH:
            return self._replace(obj, _json_patch(obj, body, what))
        if method == "PATCH":  # merge and strategic merge: lists replaced whole
            meta = dict(body.get("metadata") or {})
            self._check(obj, meta, what)
            meta.pop("resourceVersion", None)
            _merge_patch(obj, {**body, "metadata": meta} if "metadata" in body else body)
            self._server.stamp(obj)
            return obj
        raise error_for(405, what, "method not allowed")

    def _check(self, obj: Mapping[str, Any], wanted: Mapping[str, Any], what: str) -> None:
        """The preconditions of a write: the ``uid`` and ``resourceVersion`` it names, if any."""
        meta = obj["metadata"]
        for key in ("uid", "resourceVersion"):
            if wanted.get(key) and wanted[key] != meta.get(key):
                message = f"Precondition failed: {key}: {wanted[key]}, stored: {meta.get(key)}"
                raise error_for(409, what, message)

    def _replace(self, obj: dict[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
        uid = obj["metadata"].get("uid")
        obj.clear()
        obj.update(copy.deepcopy(dict(new)))
        obj["metadata"]["uid"] = uid
        self._server.stamp(obj)
        return obj

    def _list(self, path: str, query: dict[str, str]) -> dict[str, Any]:
        """A page of the collection: ``limit`` items after the ``continue`` token (the path of the
        last item of the page before), in path order as etcd's keys are."""
        paths = [p for p in self._paths(path, query) if p > query.get("continue", "")]
        limit = int(query.get("limit") or 0)
        meta = {"resourceVersion": str(self._server.version)}
        if limit and len(paths) > limit:
            paths = paths[:limit]
            meta["continue"] = paths[-1]
        return {"metadata": meta, "items": [self.objects[p] for p in paths]}

    def _create(self, ref: _Ref, body: Any, what: str) -> dict[str, Any]:
        stored: dict[str, Any] = copy.deepcopy(body)
        stored["metadata"].pop("resourceVersion", None)
        if ref.namespace:
            stored["metadata"]["namespace"] = ref.namespace
        path = _Ref(ref.group, ref.namespace, ref.resource, stored["metadata"]["name"], "").object_path
        if path in self.objects:
            raise error_for(409, what, f'{ref.resource} "{stored["metadata"]["name"]}" already exists')
        self._server.stamp(stored)
        self.objects[path] = stored
        return stored

    def _bind(self, pod: dict[str, Any], binding: Any, what: str) -> dict[str, Any]:
        """A Binding: its preconditions, then its annotations and ``spec.nodeName`` in one write."""
        if pod["spec"].get("nodeName"):
            raise error_for(409, what, f"pod {pod['metadata']['name']} is already assigned to a node")
        meta = binding.get("metadata") or {}
        self._check(pod, meta, what)
        pod["metadata"].setdefault("annotations", {}).update(meta.get("annotations") or {})
        pod["spec"]["nodeName"] = binding["target"]["name"]
        self._server.stamp(pod)
        return {"kind": "Status", "apiVersion": "v1", "status": "Success"}


class ServedKube:
    """``kube`` over plain HTTP on 127.0.0.1 (``async with``), for a service run as its own
    process: each request is ``kube``'s to answer, a ``watch=true`` GET streams ``kube``'s watch of
    the path; ``watching`` is set while a watch is open."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.watching = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._streams: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> ServedKube:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        # A watch's handler outlives its client (aiohttp does not cancel it): end them first.
        for task in self._streams:
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for this server at ``path``."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        query = list(request.query.items())
        if request.method == "GET" and request.query.get("watch") == "true":
            return await self._watch(request, query)
        body = await request.json() if request.can_read_body else None
        try:
            answer = await self.kube.request(
                request.method, request.path, query=query, body=body, content_type=request.content_type
            )
        except KubeError as exc:
            status = {"kind": "Status", "code": exc.status, "message": str(exc)}
            return web.json_response(status, status=exc.status or 500)
        return web.json_response(answer)

    async def _watch(self, request: web.Request, query: Query) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": JSON})
        await resp.prepare(request)
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        self.watching.set()
        try:
            async for event in self.kube.stream(request.path, query=query, inactivity_s=API_TIMEOUT_S):
                await resp.write(json.dumps(event).encode() + b"\n")
        finally:
            self.watching.clear()
            self._streams.discard(task)
        return resp
