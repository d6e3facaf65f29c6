"""The extender's unit tests' pods and nodes (``builders``' as an API server stores them) and an
in-memory API server."""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import builders
from builders import container, gpu

from hamipy.kube.errors import Conflict, KubeError, NotFound
from hamipy.protocol.devices import DeviceInfo


def node(
    name: str, devices: Sequence[DeviceInfo] | None = None, *, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """``builders.node`` as ``FakeKube`` stores it (uid ``uid-<name>``, resourceVersion 1), with two
    GPUs unless ``devices`` says otherwise."""
    devices = devices if devices is not None else [gpu(f"GPU-{name}-{i}", i) for i in range(2)]
    return builders.node(name, devices, uid=f"uid-{name}", resource_version="1", annotations=annotations)


def pod(
    name: str,
    *containers: dict[str, Any],
    init: Sequence[dict[str, Any]] = (),
    namespace: str = "ns",
    annotations: dict[str, str] | None = None,
    node_name: str | None = None,
    phase: str = "Pending",
) -> dict[str, Any]:
    """``builders.pod`` as ``FakeKube`` stores it (uid ``uid-<namespace>-<name>``, resourceVersion 1,
    ``phase``), with one container asking for a GPU and 1000 MiB unless ``containers`` are given."""
    return builders.pod(
        name,
        *(containers or [container(gpu=1, gpumem=1000)]),
        init=init,
        namespace=namespace,
        uid=f"uid-{namespace}-{name}",
        resource_version="1",
        annotations=annotations or {},
        node_name=node_name,
        phase=phase,
    )


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            sub = target.get(key)
            if not isinstance(sub, dict):
                sub = target[key] = {}
            _merge(sub, value)
        else:
            target[key] = copy.deepcopy(value)


WatchStep = dict[str, Any] | BaseException | asyncio.Event
"""One step of a scripted watch: an event sent, an exception raised, or a pause until the test
sets the ``asyncio.Event``."""


class FakeKube:
    """Enough of an API server for binds and informers: nodes, pods, bindings, events;
    resourceVersions enforced. Lists answer what ``nodes`` and ``pods`` hold now; each watch of a
    path replays the next script in ``streams[path]`` and, with none left, stays open and quiet."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[tuple[str, str], KubeError] = {}
        self._rv = itertools.count(100)
        self.streams: dict[str, list[list[WatchStep]]] = {}
        self.watches: list[tuple[str, dict[str, str]]] = []

    def add_node(self, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self.nodes[obj["metadata"]["name"]] = obj

    def add_pod(self, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self.pods[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj

    def _write(self, obj: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
        meta = patch.get("metadata") or {}
        want = meta.get("resourceVersion")
        if want is not None and want != obj["metadata"]["resourceVersion"]:
            raise Conflict("resourceVersion mismatch", status=409)
        uid = meta.get("uid")
        if uid is not None and uid != obj["metadata"].get("uid"):
            raise Conflict("uid precondition failed", status=409)
        patch = copy.deepcopy(patch)
        patch.get("metadata", {}).pop("resourceVersion", None)
        _merge(obj, patch)
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        return copy.deepcopy(obj)

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
        failure = self.fail.get((method, path))
        if failure is not None:
            raise failure
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4:
            obj = self.nodes.get(parts[3])
            if obj is None:
                raise NotFound(path, status=404)
            return copy.deepcopy(obj) if method == "GET" else self._write(obj, body)
        if parts[:3] == ["api", "v1", "nodes"]:
            return {"items": copy.deepcopy(list(self.nodes.values())), "metadata": {"resourceVersion": "1"}}
        if parts[:3] == ["api", "v1", "pods"]:
            q = dict(query)
            items = list(self.pods.values())
            if "fieldSelector" in q:
                want = q["fieldSelector"].split("=", 1)[1]
                items = [p for p in items if p["spec"].get("nodeName") == want]
            if "labelSelector" in q:
                label, want = q["labelSelector"].split("=", 1)
                items = [p for p in items if (p["metadata"].get("labels") or {}).get(label) == want]
            return {"items": copy.deepcopy(items), "metadata": {"resourceVersion": "1"}}
        if parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "events":
            return self._event(method, parts[3], parts[5] if len(parts) == 6 else "", body, path)
        if parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            key = (parts[3], parts[5])
            obj = self.pods.get(key)
            if obj is None:
                raise NotFound(path, status=404)
            if len(parts) == 7 and parts[6] == "binding":
                if obj["spec"].get("nodeName"):
                    raise Conflict("already bound", status=409)
                obj["spec"]["nodeName"] = body["target"]["name"]
                obj["metadata"]["resourceVersion"] = str(next(self._rv))
                return {"kind": "Status", "status": "Success"}
            return copy.deepcopy(obj) if method == "GET" else self._write(obj, body)
        raise AssertionError(f"unexpected call {method} {path}")

    def _event(self, method: str, namespace: str, name: str, body: Any, path: str) -> Any:
        """Events as the API server keeps them: by namespace and name; ``events`` is the live list."""
        found = [
            e for e in self.events if (e["metadata"]["namespace"], e["metadata"]["name"]) == (namespace, name)
        ]
        if method == "POST":
            key = (namespace, body["metadata"]["name"])
            if any((e["metadata"]["namespace"], e["metadata"]["name"]) == key for e in self.events):
                raise Conflict(f"event {key} already exists", status=409)
            self.events.append(copy.deepcopy(body))
            return body
        if not found:
            raise NotFound(path, status=404)
        if method == "PATCH":
            _merge(found[0], body)
        return copy.deepcopy(found[0])

    async def stream(
        self, path: str, *, query: Sequence[tuple[str, str]], inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        self.watches.append((path, dict(query)))
        scripts = self.streams.get(path)
        if not scripts:
            await asyncio.Event().wait()  # an open, quiet watch
        for step in scripts.pop(0) if scripts else []:
            if isinstance(step, BaseException):
                raise step
            if isinstance(step, asyncio.Event):
                await step.wait()
                continue
            yield step


def watch_event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


def gone() -> dict[str, Any]:
    """The watch event of an expired resourceVersion (HTTP 410 in the stream)."""
    return {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}
