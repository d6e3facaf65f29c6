"""Simulated nodes: Node objects the real kube-scheduler binds pods to, kept Ready by a heartbeat.

A `SimulatedNode` registers a Node (labels, capacity, annotations of your choosing), marks it
``Ready``, and every `heartbeat_interval_s` refreshes its conditions and its Lease in
``kube-node-lease`` like a kubelet does. With no node-lifecycle controller it also removes the
``node.kubernetes.io/not-ready`` taint that the TaintNodesByCondition admission plugin puts on
every new Node (the controller would remove it once the node is Ready).

The GPU side of a node (a device plugin and the kubelet stand-in that drives it) plugs in as a
`NodeAgent`: ``node.attach(agent)`` starts it with the node and stops it before the node goes.
`NodePool` owns a set of nodes for a test or for ``make up`` and removes them all on exit.

The node's calls go through ``hamipy.kube.client.RawKube`` (``SimulatedNode.kube``) over the pool's
``ApiClient``; its errors are ``hamipy.kube.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Mapping
from types import MappingProxyType, TracebackType
from typing import Any, Protocol, Self

from hamipy.kube.client import STRATEGIC_MERGE_PATCH, RawKube
from hamipy.kube.errors import Conflict, NotFound
from hamipy.kube.resources import node_path, patch_node_annotations

log = logging.getLogger(__name__)

SIMULATED_LABEL = "hami-py.io/simulated-node"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
LEASE_NAMESPACE = "kube-node-lease"
# The kubelet's defaults: node status every 10 s, a 40 s lease.
HEARTBEAT_INTERVAL_S = 10.0
LEASE_DURATION_S = 40
# After a failed beat, retry sooner than the interval, but not in a tight loop.
RETRY_DELAY_S = 1.0

DEFAULT_CAPACITY: Mapping[str, str] = MappingProxyType({"cpu": "16", "memory": "64Gi", "pods": "110"})
# What kubectl and the kubelet send for built-in kinds: lists merge by their keys (conditions by type).


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """What a simulated node looks like to the API."""

    name: str
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Quantities as strings, as in the API (``{"nvidia.com/gpu": "4"}`` adds to the defaults).
    capacity: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # None: allocatable equals capacity.
    allocatable: Mapping[str, str] | None = None
    taints: tuple[Mapping[str, str], ...] = ()

    def full_capacity(self) -> dict[str, str]:
        return {**DEFAULT_CAPACITY, **self.capacity}

    def node_body(self) -> dict[str, Any]:
        """The Node object to create (status is written separately: create ignores most of it)."""
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            SIMULATED_LABEL: "true",
            **self.labels,
        }
        spec: dict[str, Any] = {}
        if self.taints:
            spec["taints"] = [dict(t) for t in self.taints]
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels, "annotations": dict(self.annotations)},
            "spec": spec,
        }

    def status_body(self, now: datetime.datetime) -> dict[str, Any]:
        """The status a healthy kubelet reports: capacity, allocatable, Ready and no pressure."""
        capacity = self.full_capacity()
        allocatable = {**capacity, **self.allocatable} if self.allocatable is not None else capacity
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")

        def cond(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }

        return {
            "status": {
                "capacity": capacity,
                "allocatable": allocatable,
                "conditions": [
                    cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "simulated"),
                    cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "simulated"),
                    cond("PIDPressure", "False", "KubeletHasSufficientPID", "simulated"),
                    cond("Ready", "True", "KubeletReady", "simulated node is posting ready status"),
                ],
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.name},
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "v1.34.4-hamipy-sim",
                    "kubeProxyVersion": "",
                    "containerRuntimeVersion": "simulated://0",
                    "kernelVersion": "",
                    "osImage": "hamipy simulated node",
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                },
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            }
        }


class NodeAgent(Protocol):
    """Something that runs with a simulated node (e.g. a device plugin + kubelet stand-in)."""

    async def start(self, node: SimulatedNode) -> None: ...

    async def stop(self) -> None: ...


class NamedNode(Protocol):
    """What an agent that only needs the node's name sees of it (a simulated or a kubelet's node)."""

    @property
    def name(self) -> str: ...


async def delete_node(kube: RawKube, name: str) -> None:
    """Delete the Node and its Lease (either may be gone already)."""
    for path in (node_path(name), _lease_path(name)):
        with contextlib.suppress(NotFound):
            await kube.request("DELETE", path)


async def remove_not_ready_taint(kube: RawKube, node: Mapping[str, Any]) -> bool:
    """Drop ``node.kubernetes.io/not-ready`` from a Ready node, as the node-lifecycle controller
    would (it does not run here: ``config.CONTROLLERS``); True if there was one."""
    taints = list((node.get("spec") or {}).get("taints") or [])
    kept = [t for t in taints if t.get("key") != NOT_READY_TAINT]
    if len(kept) == len(taints):
        return False
    name = str((node.get("metadata") or {}).get("name"))
    await kube.request(
        "PATCH", node_path(name), body={"spec": {"taints": kept or None}}, content_type=STRATEGIC_MERGE_PATCH
    )
    return True


def _micro_time(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _lease_path(name: str = "") -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
    return f"{base}/{name}" if name else base


class SimulatedNode:
    """One Node object plus its heartbeat task and attached agents."""

    def __init__(
        self, spec: NodeSpec, api: Any, *, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    ) -> None:
        self.spec = spec
        self.api = api
        """The kubernetes-asyncio ``ApiClient`` (agents reach the API through it too)."""
        self.kube = RawKube(api)
        self.heartbeat_interval_s = heartbeat_interval_s
        self._agents: list[NodeAgent] = []
        self._started_agents: list[NodeAgent] = []
        self._task: asyncio.Task[None] | None = None
        self.beats = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def attach(self, agent: NodeAgent) -> None:
        """Run `agent` with this node: started by `start` after the node is Ready, stopped by `stop`."""
        if self._task is not None:
            raise RuntimeError(f"SimulatedNode.attach: node {self.name!r} is running; attach before start")
        self._agents.append(agent)

    async def register(self) -> None:
        """Create (or adopt) the Node and its Lease and make it Ready and untainted."""
        with contextlib.suppress(Conflict):
            await self.kube.request("POST", node_path(), body=self.spec.node_body())
        await self.heartbeat()

    async def heartbeat(self) -> None:
        """One beat: conditions + capacity, Lease renewal, and the not-ready taint removed."""
        now = datetime.datetime.now(datetime.UTC)
        node = await self.kube.request(
            "PATCH",
            f"{node_path(self.name)}/status",
            body=self.spec.status_body(now),
            content_type=STRATEGIC_MERGE_PATCH,
        )
        await remove_not_ready_taint(self.kube, node)
        await self._renew_lease(now)
        self.beats += 1

    async def _renew_lease(self, now: datetime.datetime) -> None:
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": _micro_time(now),
        }
        try:
            await self.kube.request(
                "PATCH", _lease_path(self.name), body={"spec": spec}, content_type=STRATEGIC_MERGE_PATCH
            )
        except NotFound:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": LEASE_NAMESPACE},
                "spec": {**spec, "acquireTime": _micro_time(now)},
            }
            await self.kube.request("POST", _lease_path(), body=body)

    async def _beat_forever(self) -> None:
        while True:
            try:
                await self.heartbeat()
                delay = self.heartbeat_interval_s
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("simulated node %s: heartbeat failed; retrying", self.name)
                delay = RETRY_DELAY_S
            await asyncio.sleep(delay)

    async def start(self) -> None:
        """Register the node, start its heartbeat task, then start its agents."""
        if self._task is not None:
            return
        await self.register()
        self._task = asyncio.create_task(self._beat_forever(), name=f"devcluster-heartbeat:{self.name}")
        for agent in self._agents:
            await agent.start(self)
            self._started_agents.append(agent)

    async def stop(self, *, delete: bool = True) -> None:
        """Stop the agents (newest first), the heartbeat, and delete the Node and its Lease."""
        while self._started_agents:
            await self._started_agents.pop().stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if delete:
            await self.delete()

    async def delete(self) -> None:
        await delete_node(self.kube, self.name)

    async def patch_annotations(self, annotations: Mapping[str, str | None]) -> None:
        """Set (or with None, remove) node annotations, as a device plugin registering GPUs does."""
        await patch_node_annotations(self.kube, self.name, annotations)

    async def set_capacity(
        self, capacity: Mapping[str, str], allocatable: Mapping[str, str] | None = None
    ) -> None:
        """Change capacity/allocatable (merged into the spec's) and report it at once."""
        self.spec = dataclasses.replace(
            self.spec,
            capacity={**self.spec.capacity, **capacity},
            allocatable=(
                {**(self.spec.allocatable or {}), **allocatable}
                if allocatable is not None
                else self.spec.allocatable
            ),
        )
        await self.heartbeat()


class NodePool:
    """The simulated nodes of one test (or of ``make up``); ``async with`` removes them all."""

    def __init__(self, api: Any, *, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.api = api
        self.heartbeat_interval_s = heartbeat_interval_s
        self.nodes: dict[str, SimulatedNode] = {}

    async def add(self, spec: NodeSpec, *, agents: tuple[NodeAgent, ...] = ()) -> SimulatedNode:
        """Register and start a node (and its agents); return it once it is Ready."""
        if spec.name in self.nodes:
            raise ValueError(f"NodePool.add: node {spec.name!r} already in this pool")
        node = SimulatedNode(spec, self.api, heartbeat_interval_s=self.heartbeat_interval_s)
        for agent in agents:
            node.attach(agent)
        self.nodes[spec.name] = node
        await node.start()
        return node

    async def remove(self, name: str) -> None:
        node = self.nodes.pop(name)
        await node.stop()

    async def close(self) -> None:
        """Stop and delete every node; errors are logged and the rest still removed."""
        errors: list[BaseException] = []
        for name in list(self.nodes):
            try:
                await self.remove(name)
            except Exception as exc:
                log.exception("simulated node %s: removal failed", name)
                errors.append(exc)
        if errors:
            raise errors[0]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
