"""A binder and a scheduler over a ``FakeKube`` (``bind_rig``), and a leader election decided in
advance (``elected``), for the extender's unit tests."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, cast

import msgspec
from builders import REPORT, gpu, gpu_node
from fake_kube import FakeKube

from hamipy.extender.binding import Binder
from hamipy.extender.eviction import Evictor
from hamipy.extender.extender_args import ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs
from hamipy.extender.leadership import LEADER_URL_ANNOTATION
from hamipy.extender.model import ClusterModel
from hamipy.extender.scheduler import Scheduler
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import NullKube
from hamipy.kube.events import EventRecorder
from hamipy.kube.leader import LeaderElector, LeaderInfo, LeaseSettings
from hamipy.kube.resources import node_path
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.identifiers import NodeName
from hamipy.protocol.node_lock import NodeLock, format_node_lock

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
        self.kube.add(obj)
        self.model.apply_pod("ADDED", self.kube.pod(obj["metadata"]["namespace"], obj["metadata"]["name"]))

    def lock(self, node_name: str = "n") -> str | None:
        """The node lock's value on ``node_name`` now, None when there is none."""
        value: str | None = self.kube.node(node_name)["metadata"].get("annotations", {}).get(keys.NODE_LOCK)
        return value

    def locked_by(self, namespace: str, name: str | None, when: datetime, node_name: str = "n") -> str:
        """Put a lock taken at ``when`` by ``namespace/name`` (``name`` None: a legacy lock, time
        only) on the node; returns its value."""
        owner = (namespace, name) if name is not None else (None, None)
        value = format_node_lock(NodeLock(when.replace(microsecond=0), *owner))
        self.kube.node(node_name)["metadata"]["annotations"][keys.NODE_LOCK] = value
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
    kube = FakeKube(*(nodes or (gpu_node("n", [gpu("A", 0, count=2)]),)))
    model = ClusterModel(count_resource=config.nvidia.resource_count_name)
    model.replace_nodes(kube.items(node_path()))
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
    events = EventRecorder(NullKube(), component="hamipy-extender", logger=telemetry.logger)
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
    ours = [gpu_node("n", [gpu("A", 0, count=2)])] if not nodes else list(nodes)
    for n in ours:
        n["metadata"].setdefault("annotations", {}).update(REPORT)
    return bind_rig(settings, *ours, exclusive=False, **kw)


def bind_args(p: dict[str, Any], node_name: str = "n") -> ExtenderBindingArgs:
    """The ExtenderBindingArgs kube-scheduler sends to bind ``p`` to ``node_name``."""
    meta = p["metadata"]
    return ExtenderBindingArgs(
        pod_name=meta["name"], pod_namespace=meta["namespace"], pod_uid=meta["uid"], node=NodeName(node_name)
    )


def filter_args(p: dict[str, Any], names: list[str]) -> ExtenderArgs:
    """The ExtenderArgs kube-scheduler sends to filter ``p`` over the nodes ``names``."""
    return msgspec.convert({"Pod": p, "NodeNames": names}, ExtenderArgs)


def preempt_args(args: dict[str, Any]) -> ExtenderPreemptionArgs:
    """ExtenderPreemptionArgs as kube-scheduler sends them (Go field names)."""
    return msgspec.convert(args, ExtenderPreemptionArgs)


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
