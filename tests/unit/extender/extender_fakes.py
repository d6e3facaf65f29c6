"""The extender's unit tests' pods and nodes (``builders``' as an API server stores them), an
in-memory API server, and a binder and scheduler over it (``bind_rig``)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import io
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any, Final, cast

import builders
from builders import container, gpu

from hamipy.extender.binding import Binder
from hamipy.extender.eviction import Evictor
from hamipy.extender.leadership import LEADER_URL_ANNOTATION
from hamipy.extender.model import ClusterModel
from hamipy.extender.scheduler import Scheduler
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.errors import Conflict, KubeError, NotFound
from hamipy.kube.events import EventRecorder
from hamipy.kube.leader import LeaderElector, LeaderInfo, LeaseSettings
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import DeviceInfo
from hamipy.protocol.node_handshake import plugin_report
from hamipy.protocol.node_lock import NodeLock, format_node_lock


def node(
    name: str, devices: Sequence[DeviceInfo] | None = None, *, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """``builders.node`` as ``FakeKube`` stores it (uid ``uid-<name>``, resourceVersion 1), with two
    GPUs unless ``devices`` says otherwise."""
    devices = devices if devices is not None else [gpu(f"GPU-{name}-{i}", i) for i in range(2)]
    return builders.node(name, devices, uid=f"uid-{name}", resource_version="1", annotations=annotations)


REPORT: Final = plugin_report(datetime(2026, 11, 24, 10, 0, tzinfo=UTC))
"""Our device plugin's report: the handshake and our marker."""
REPORTED: Final = REPORT[keys.NODE_HANDSHAKE]
"""A ``Reported_`` handshake, as a device plugin answers."""


def our_node(name: str, devices: Sequence[DeviceInfo] | None = None) -> dict[str, Any]:
    """``node`` as our device plugin registers it: its last report carries our marker."""
    return node(name, devices, annotations=dict(REPORT))


def pod(
    name: str,
    *containers: dict[str, Any],
    init: Sequence[dict[str, Any]] = (),
    namespace: str = "ns",
    annotations: dict[str, str] | None = None,
    node_name: str | None = None,
    phase: str = "Pending",
    scheduler_name: str = "hami-scheduler",
) -> dict[str, Any]:
    """``builders.pod`` as ``FakeKube`` stores it (uid ``uid-<namespace>-<name>``, resourceVersion 1,
    ``phase``, ``schedulerName`` as the webhook sets it), with one container asking for a GPU and
    1000 MiB unless ``containers`` are given."""
    return builders.pod(
        name,
        *(containers or [container(gpu=1, gpumem=1000)]),
        init=init,
        namespace=namespace,
        uid=f"uid-{namespace}-{name}",
        resource_version="1",
        annotations=annotations or {},
        node_name=node_name,
        scheduler_name=scheduler_name,
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


RequestHook = Callable[[str, str, Any], Awaitable[None] | None]
"""Called with (method, path, body) as each request arrives, before it is answered: it may change
the stored objects (another writer got there first), raise a ``KubeError`` (this request fails) or,
as a coroutine, hold the request until the test lets it go."""

WatchStep = dict[str, Any] | BaseException | asyncio.Event
"""One step of a scripted watch: an event sent, an exception raised, or a pause until the test
sets the ``asyncio.Event``."""


class FakeKube:
    """Enough of an API server for binds and informers: nodes, pods (their status and deletion),
    bindings, events, quotas, PodDisruptionBudgets;
    resourceVersions and UID preconditions enforced (patches and bindings). Lists answer what
    ``nodes`` and ``pods`` hold now; each watch of a path replays the next script in
    ``streams[path]`` and, with none left, stays open and quiet. ``fail`` fails every request to
    a (method, path); ``on_request`` sees each request first (``RequestHook``)."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.quotas: list[dict[str, Any]] = []
        self.pdbs: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []
        self.events: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[tuple[str, str], KubeError] = {}
        self._rv = itertools.count(100)
        self.streams: dict[str, list[list[WatchStep]]] = {}
        self.watches: list[tuple[str, dict[str, str]]] = []
        self.on_request: RequestHook | None = None

    def add_node(self, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self.nodes[obj["metadata"]["name"]] = obj

    def add_pod(self, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self.pods[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj

    def write_node(self, name: str, annotations: dict[str, str | None]) -> None:
        """Another writer changes the node's ``annotations`` (None removes one): a new
        resourceVersion, as a heartbeat or the device plugin would make."""
        self._write(self.nodes[name], {"metadata": {"annotations": annotations}})

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
        if self.on_request is not None:
            held = self.on_request(method, path, body)
            if inspect.isawaitable(held):
                await held
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
        if parts[:3] == ["api", "v1", "resourcequotas"]:
            return {"items": copy.deepcopy(self.quotas), "metadata": {"resourceVersion": "1"}}
        if parts[:3] == ["apis", "policy", "v1"]:
            return {"items": copy.deepcopy(self.pdbs), "metadata": {"resourceVersion": "1"}}
        if parts[:3] == ["api", "v1", "pods"]:
            q = dict(query)
            items = list(self.pods.values())
            if "fieldSelector" in q:  # spec.nodeName=<node>, or spec.nodeName!= (bound pods)
                field, want = q["fieldSelector"].split("=", 1)
                if field.endswith("!"):
                    items = [p for p in items if p["spec"].get("nodeName", "") != want]
                else:
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
            if method == "DELETE":
                uid = ((body or {}).get("preconditions") or {}).get("uid")
                if uid and uid != obj["metadata"].get("uid"):
                    raise Conflict("uid precondition failed", status=409)
                del self.pods[key]
                self.deleted.append(key)
                return {"kind": "Status", "status": "Success"}
            if len(parts) == 7 and parts[6] == "binding":
                if obj["spec"].get("nodeName"):
                    raise Conflict("already bound", status=409)
                meta = body.get("metadata") or {}
                uid = meta.get("uid")
                if uid and uid != obj["metadata"].get("uid"):
                    raise Conflict("uid precondition failed", status=409)
                version = meta.get("resourceVersion")
                if version and version != obj["metadata"]["resourceVersion"]:
                    raise Conflict("resourceVersion precondition failed", status=409)
                # As the API server does: the Binding's annotations land with spec.nodeName.
                obj["metadata"].setdefault("annotations", {}).update(meta.get("annotations") or {})
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


# -- a binder and a scheduler over a FakeKube -----------------------------------------------------------

BIND_SETTINGS = ExtenderSettings(bind_timeout_s=1.0, api_timeout_s=1.0)
"""Bind settings of the unit tests: a short wait for a lock, the default lock expiry (5 minutes)."""


@dataclasses.dataclass
class BindRig:
    kube: FakeKube
    model: ClusterModel
    binder: Binder
    scheduler: Scheduler
    telemetry: Telemetry
    log: io.StringIO
    """The extender's log lines (JSON), as written."""
    events: EventRecorder
    evictor: Evictor | None

    def add_watched_pod(self, obj: dict[str, Any]) -> None:
        """Store ``obj`` and let the model see it, as the pod watch delivers a new pod."""
        self.kube.add_pod(obj)
        self.model.apply_pod("ADDED", self.kube.pods[(obj["metadata"]["namespace"], obj["metadata"]["name"])])

    def lock(self, node_name: str = "n") -> str | None:
        """The node lock's value on ``node_name`` now, None when there is none."""
        value: str | None = self.kube.nodes[node_name]["metadata"].get("annotations", {}).get(keys.NODE_LOCK)
        return value

    def locked_by(self, namespace: str, name: str | None, when: datetime, node_name: str = "n") -> str:
        """Put a lock taken at ``when`` by ``namespace/name`` (``name`` None: a legacy lock, time
        only) on the node; returns its value."""
        owner = (namespace, name) if name is not None else (None, None)
        value = format_node_lock(NodeLock(when.replace(microsecond=0), *owner))
        self.kube.nodes[node_name]["metadata"]["annotations"][keys.NODE_LOCK] = value
        return value


def bind_rig(
    settings: ExtenderSettings = BIND_SETTINGS,
    *nodes: dict[str, Any],
    wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    config: Config | None = None,
    exclusive: bool = True,
) -> BindRig:
    """A ``Binder`` (and the ``Scheduler`` around it) over a ``FakeKube`` holding ``nodes`` (none:
    node ``n`` with one GPU ``A`` split 2 ways, registered by HAMi's device plugin: binds there take
    the locked path and leave the lock for its Allocate), whose model has seen the nodes and no pods;
    ``config`` the shared configuration (default: ``Config()``); ``exclusive`` whether this replica
    alone writes allocations."""
    config = config if config is not None else Config()
    kube = FakeKube()
    for n in nodes or (node("n", [gpu("A", 0, count=2)]),):
        kube.add_node(n)
    model = ClusterModel(count_resource=config.nvidia.resource_count_name)
    model.replace_nodes(kube.nodes.values())
    model.replace_pods([])
    log = io.StringIO()
    telemetry = Telemetry.create(stream=log)
    binder = Binder(
        api=kube,
        model=model,
        config=config,
        settings=settings,
        telemetry=telemetry,
        wall_clock=wall_clock,
        exclusive=lambda: exclusive,
    )
    events = EventRecorder(None, component="hamipy-extender", logger=telemetry.logger)
    evictor = None
    if settings.preemption:
        evictor = Evictor(
            api=kube,
            model=model,
            events=events,
            telemetry=telemetry,
            scheduler_name=config.scheduler_name,
            timeout_s=settings.api_timeout_s,
        )
    scheduler = Scheduler(
        model=model,
        config=config,
        settings=settings,
        telemetry=telemetry,
        events=events,
        binder=binder,
        evictor=evictor,
    )
    return BindRig(kube, model, binder, scheduler, telemetry, log, events, evictor)


def shared_rig(settings: ExtenderSettings = BIND_SETTINGS, *nodes: dict[str, Any], **kw: Any) -> BindRig:
    """``bind_rig`` for a replica that does not decide alone (a leader catching up, replicas without
    leader election), on nodes our device plugin serves (``nodes`` get our marker): binds take the
    locked path, and the lock lasts only for the bind (lock sessions, release at once)."""
    ours = [node("n", [gpu("A", 0, count=2)])] if not nodes else list(nodes)
    for n in ours:
        n["metadata"].setdefault("annotations", {}).update(REPORT)
    return bind_rig(settings, *ours, exclusive=False, **kw)


def bind_args(p: dict[str, Any], node_name: str = "n") -> dict[str, str]:
    """The ExtenderBindingArgs kube-scheduler sends to bind ``p`` to ``node_name``."""
    meta = p["metadata"]
    return {
        "PodName": meta["name"],
        "PodNamespace": meta["namespace"],
        "PodUID": meta["uid"],
        "Node": node_name,
    }


class _Elected:
    """Stands in for a ``LeaderElector`` whose Lease names ``identity`` at ``transitions``."""

    def __init__(self, identity: str, transitions: int, annotations: dict[str, str]) -> None:
        self.info = LeaderInfo(identity=identity, annotations=annotations, transitions=transitions)
        self.settings = LeaseSettings(namespace="ns", name="lease", identity="me_1")

    def is_leader(self) -> bool:
        return self.info.identity == self.settings.identity

    @property
    def leader(self) -> LeaderInfo:
        return self.info

    def wait_changed(self) -> Coroutine[Any, Any, bool]:
        return asyncio.Event().wait()

    async def wait_leader(self, timeout_s: float) -> LeaderInfo:
        return self.info


def elected(*, transitions: int = 1, leader_url: str | None = None) -> LeaderElector:
    """An election this replica has won (``leader_url`` None) or another replica, serving at
    ``leader_url``, has."""
    if leader_url is None:
        return cast(LeaderElector, _Elected("me_1", transitions, {}))
    return cast(LeaderElector, _Elected("other_2", transitions, {LEADER_URL_ANNOTATION: leader_url}))
