"""Builders for Node/Pod JSON and an in-memory API server for the extender's unit tests."""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

from hamipy.kube.errors import Conflict, KubeError, NotFound
from hamipy.protocol import keys
from hamipy.protocol.devices import DeviceInfo
from hamipy.protocol.node_devices import encode_node_devices

GPU_TYPE = "NVIDIA-Tesla V100-PCIE-32GB"


def gpu(
    uuid: str,
    index: int = 0,
    *,
    count: int = 10,
    mem: int = 32768,
    core: int = 100,
    type_: str = GPU_TYPE,
    numa: int = 0,
    health: bool = True,
    mode: str = "hami-core",
) -> DeviceInfo:
    return DeviceInfo(uuid, index, count, mem, core, type_, numa, mode, health)


def node(
    name: str, devices: Sequence[DeviceInfo] | None = None, *, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    devices = devices if devices is not None else [gpu(f"GPU-{name}-{i}", i) for i in range(2)]
    ann = {keys.NODE_REGISTER: encode_node_devices(devices), **(annotations or {})}
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "annotations": ann, "resourceVersion": "1"},
        "status": {"allocatable": {keys.RESOURCE_COUNT: str(len(devices) * 10)}},
    }


def container(name: str = "main", **limits: str) -> dict[str, Any]:
    names = {
        "gpu": keys.RESOURCE_COUNT,
        "mem": keys.RESOURCE_MEMORY,
        "pct": keys.RESOURCE_MEMORY_PERCENTAGE,
        "cores": keys.RESOURCE_CORES,
    }
    out: dict[str, Any] = {"name": name, "image": "pause"}
    if limits:
        out["resources"] = {"limits": {names[k]: v for k, v in limits.items()}}
    return out


def pod(
    name: str,
    *containers: dict[str, Any],
    init: Sequence[dict[str, Any]] = (),
    namespace: str = "ns",
    annotations: dict[str, str] | None = None,
    node_name: str | None = None,
    phase: str = "Pending",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers) or [container(gpu="1", mem="1000")]}
    if init:
        spec["initContainers"] = list(init)
    if node_name:
        spec["nodeName"] = node_name
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "annotations": dict(annotations or {}),
            "resourceVersion": "1",
        },
        "spec": spec,
        "status": {"phase": phase},
    }


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
                key, want = q["labelSelector"].split("=", 1)
                items = [p for p in items if (p["metadata"].get("labels") or {}).get(key) == want]
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
