"""A kubelet stand-in: the kubelet's device-manager role, over the real device plugin gRPC API.

GPU nodes run the real kubelet where the machine allows it (``kubelet_nodes``: mount namespaces
need root); this is the one deliberate stand-in, for simulated nodes and the benchmarks
(docs/design.md#2-real-nodes-one-stand-in): a `NodeAgent` for a `SimulatedNode` that does what a
kubelet's device manager does (``pkg/kubelet/cm/devicemanager``, Kubernetes v1.34), with a device
plugin talking to it exactly as it would talk to a kubelet:

- it serves ``v1beta1.Registration/Register`` on ``<plugin_dir>/kubelet.sock``, after deleting
  every socket in the directory (how plugins learn that the kubelet restarted);
- on ``Register`` it dials ``<plugin_dir>/<endpoint>``, asks ``GetDevicePluginOptions`` and reads
  ``ListAndWatch`` for as long as the plugin lives; the Node's capacity is the number of devices and
  its allocatable the number of healthy ones (0 while the plugin is gone);
- it watches the pods bound to its node (a ``hamipy.kube.informer.Informer``; after every list, pods
  that went while nobody watched free their devices) and admits them one at a time, in the order
  they were bound: for each container, init containers first, it chooses devices
  (``GetPreferredAllocation`` when the plugin offers it) and calls ``Allocate``, then
  ``PreStartContainer`` if asked, and reports the pod ``Running``; a pod it cannot admit is
  reported ``Failed`` with ``UnexpectedAdmissionError``;
- it serves the PodResources API's ``List`` (``pod_resources_socket``, by default
  ``pod-resources.sock`` in the plugin directory) as the kubelet does: the pods it admitted and has
  not rejected, and the pod it is admitting, each regular and restartable init container with the
  device IDs it holds;
- a pod that finishes or is deleted frees its devices, and a deleted pod is removed (grace 0);
- `restart` is a kubelet restart: sockets deleted, plugins must register again, and the
  allocations made so far are kept (the kubelet's checkpoint).

What each container received is in `KubeletStandIn.allocations` (and, with ``record_dir``, one
JSON file per container, for ``make up``). The decisions themselves are plain functions in
`hamipy.devcluster.kubelet_admission`; this module is the I/O around them.

Not done: no containers run (statuses are made up: init containers completed, the rest running),
no topology manager (NUMA hints are recorded, not used), no CDI, no resource-usage accounting beyond
device IDs, no eviction, and nothing is reported to the API beyond the Node's device counts and the
pod statuses above.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import json
import logging
import os
import stat
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, NamedTuple, TypeVar

import grpc
import grpc.aio

from hamipy.devcluster.errors import WaitTimeout
from hamipy.devcluster.kubelet_admission import (
    AdmissionError,
    ContainerKind,
    ContainerRequest,
    PluginDevice,
    admission_message,
    begin_choice,
    container_requests,
    finish_choice,
    free_devices,
    grpc_error_text,
    is_extended_resource_name,
    node_resources,
    pod_is_deleting,
    pod_is_terminal,
    rejected_status,
    release_reusable,
    running_status,
    waiting_status,
)
from hamipy.devcluster.kubeobjects import API_TIMEOUT_S
from hamipy.devcluster.nodes import SimulatedNode
from hamipy.kube.client import STRATEGIC_MERGE_PATCH, KubeApi
from hamipy.kube.errors import Conflict, KubeError, NotFound
from hamipy.kube.informer import ChangeKind, Informer, InformerSettings
from hamipy.kube.resources import node_pods_query, pod_path
from hamipy.kubelet_api import HEALTHY, KUBELET_SOCKET, VERSION
from hamipy.kubelet_api.podresources_v1 import api_pb2 as podresources_pb2
from hamipy.kubelet_api.podresources_v1 import api_pb2_grpc as podresources_pb2_grpc
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc

__all__ = [
    "ContainerAllocation",
    "ContainerKey",
    "DeviceNode",
    "KubeletStandIn",
    "Mount",
    "ResourceAllocation",
    "StandInSettings",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_HOST_IP: Final = "127.0.0.1"  # what SimulatedNode reports as the node's InternalIP
# A unix socket path is at most 107 bytes (sun_path is 108, NUL included).
_MAX_SOCKET_PATH: Final = 107


@dataclasses.dataclass(frozen=True)
class StandInSettings:
    """Timeouts and retry pacing of the stand-in."""

    # The kubelet dials a registering plugin with a 10 s timeout.
    dial_timeout_s: float = 10.0
    # Every unary call to a plugin; the kubelet gives PreStartContainer 30 s
    # (KubeletPreStartContainerRPCTimeoutInSecs).
    plugin_call_timeout_s: float = 30.0
    # The server ends each pod watch after this; it is re-opened from its resourceVersion.
    watch_timeout_s: int = 60
    # A pod watch silent for longer (no event, no bookmark, no server-side end) is dropped.
    watch_inactivity_s: float = 90.0
    # Backoff after a failed list/watch or API write: short, since the apiserver is local.
    first_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    # Attempts to post a pod status before giving up on that pod.
    status_attempts: int = 5
    list_page_size: int = 500


class ContainerKey(NamedTuple):
    namespace: str
    pod: str
    container: str


class Mount(NamedTuple):
    container_path: str
    host_path: str
    read_only: bool


class DeviceNode(NamedTuple):
    container_path: str
    host_path: str
    permissions: str


@dataclasses.dataclass(frozen=True)
class ResourceAllocation:
    """What one container got for one resource: the device IDs and the plugin's ``Allocate`` answer."""

    resource: str
    device_ids: tuple[str, ...]
    envs: Mapping[str, str]
    mounts: tuple[Mount, ...] = ()
    devices: tuple[DeviceNode, ...] = ()
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()

    @classmethod
    def from_response(
        cls, resource: str, device_ids: tuple[str, ...], response: api_pb2.ContainerAllocateResponse
    ) -> ResourceAllocation:
        return cls(
            resource=resource,
            device_ids=device_ids,
            envs=dict(response.envs),
            mounts=tuple(Mount(m.container_path, m.host_path, m.read_only) for m in response.mounts),
            devices=tuple(DeviceNode(d.container_path, d.host_path, d.permissions) for d in response.devices),
            annotations=dict(response.annotations),
            cdi_devices=tuple(c.name for c in response.cdi_devices),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "device_ids": list(self.device_ids),
            "envs": dict(self.envs),
            "mounts": [m._asdict() for m in self.mounts],
            "devices": [d._asdict() for d in self.devices],
            "annotations": dict(self.annotations),
            "cdi_devices": list(self.cdi_devices),
        }


@dataclasses.dataclass(frozen=True)
class ContainerAllocation:
    """Everything one container received from device plugins (one entry per resource it asked for)."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    kind: ContainerKind
    resources: tuple[ResourceAllocation, ...]

    @property
    def key(self) -> ContainerKey:
        return ContainerKey(self.namespace, self.pod, self.container)

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(d for r in self.resources for d in r.device_ids)

    @property
    def envs(self) -> dict[str, str]:
        """The environment from all resources (a later resource wins a clash, as in the kubelet)."""
        return {k: v for r in self.resources for k, v in r.envs.items()}

    @property
    def mounts(self) -> tuple[Mount, ...]:
        return tuple(m for r in self.resources for m in r.mounts)

    def for_resource(self, resource: str) -> ResourceAllocation:
        for r in self.resources:
            if r.resource == resource:
                return r
        raise KeyError(
            f"container {self.key} got no {resource!r} (it got {[r.resource for r in self.resources]})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "pod": self.pod,
            "pod_uid": self.pod_uid,
            "container": self.container,
            "kind": self.kind,
            "resources": [r.to_json() for r in self.resources],
        }


@dataclasses.dataclass(eq=False)
class _Endpoint:
    """One registered plugin connection; a new registration for the resource replaces it."""

    resource: str
    socket: Path
    channel: grpc.aio.Channel
    stub: api_pb2_grpc.DevicePluginAsyncStub
    options: api_pb2.DevicePluginOptions
    connected: bool = True
    listed: bool = False  # the first ListAndWatch answer has come
    task: asyncio.Task[None] | None = None


class _PodFeed:
    """The pod informer's handler: what it tells, queued in order for the stand-in to apply (the
    informer's calls are synchronous; freeing devices and deleting pods are not)."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def listed(self, objects: list[dict[str, Any]]) -> None:
        self.events.put_nowait(("LISTED", objects))

    def changed(self, kind: ChangeKind, obj: dict[str, Any]) -> None:
        self.events.put_nowait((kind, obj))


class _StdlibLogger:
    """The informer's structlog-style calls (event and fields) on this module's stdlib logger."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _line(self, event: str, fields: dict[str, Any]) -> str:
        details = " ".join(f"{key}={value!r}" for key, value in fields.items())
        return f"{self.prefix}: {event}" + (f" ({details})" if details else "")

    def info(self, event: str, **fields: Any) -> None:
        log.info("%s", self._line(event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        log.warning("%s", self._line(event, fields))


def _remove_sockets(directory: Path) -> list[str]:
    """Delete every socket in `directory` (not files, not folders), as a starting kubelet does."""
    removed: list[str] = []
    for entry in os.scandir(directory):
        try:
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                os.unlink(entry.path)
                removed.append(entry.name)
        except FileNotFoundError:
            continue
    return removed


def _write_json(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _rpc_error(exc: grpc.aio.AioRpcError) -> str:
    return grpc_error_text(exc.code().name, exc.details() or "")


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, standin: KubeletStandIn) -> None:
        self._standin = standin

    async def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> api_pb2.Empty:
        await self._standin._register(request, context)
        return api_pb2.Empty()


class _PodResources(podresources_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, standin: KubeletStandIn) -> None:
        self._standin = standin

    async def List(
        self,
        request: podresources_pb2.ListPodResourcesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> podresources_pb2.ListPodResourcesResponse:
        return self._standin.pod_resources()


def _listed_containers(pod: Mapping[str, Any]) -> list[str]:
    """The containers the PodResources API lists: restartable init containers, then the regular ones."""
    spec = pod.get("spec") or {}
    sidecars = [c for c in spec.get("initContainers") or () if c.get("restartPolicy") == "Always"]
    return [str(c.get("name", "")) for c in [*sidecars, *(spec.get("containers") or ())]]


class KubeletStandIn:
    """The device-manager part of a kubelet for one simulated node (a `NodeAgent`).

    ``plugin_dir`` is the node's device-plugin directory (``/var/lib/kubelet/device-plugins`` on a
    real node; keep it short: socket paths must stay under about 100 characters).
    """

    def __init__(
        self,
        plugin_dir: Path,
        *,
        record_dir: Path | None = None,
        settings: StandInSettings | None = None,
        pod_resources_socket: Path | None = None,
    ) -> None:
        self.plugin_dir = Path(plugin_dir).absolute()
        self.pod_resources_socket = (
            Path(pod_resources_socket).absolute()
            if pod_resources_socket is not None
            else self.plugin_dir / "pod-resources.sock"
        )
        for socket in (self.plugin_dir / KUBELET_SOCKET, self.pod_resources_socket):
            if len(os.fsencode(socket)) > _MAX_SOCKET_PATH:
                raise ValueError(
                    f"KubeletStandIn: socket {str(socket)!r} is too long for unix sockets "
                    f"(at most {_MAX_SOCKET_PATH} bytes); use a short directory"
                )
        self.record_dir = Path(record_dir) if record_dir is not None else None
        self.settings = settings or StandInSettings()
        self.registrations: collections.Counter[str] = collections.Counter()
        """How many times a plugin registered each resource."""
        self.errors: list[BaseException] = []
        """Unexpected failures of the stand-in's own tasks (a test can assert there are none)."""
        self.restarts = 0
        self._node: SimulatedNode | None = None
        self._server: grpc.aio.Server | None = None
        self._endpoints: dict[str, _Endpoint] = {}
        self._devices: dict[str, dict[str, PluginDevice]] = {}
        self._allocations: dict[ContainerKey, ContainerAllocation] = {}
        self._by_pod: dict[str, list[ContainerKey]] = {}
        self._pods: dict[str, dict[str, Any]] = {}
        self._seen: set[str] = set()
        self._served: set[str] = set()
        self._rejected: set[str] = set()
        self._admitting: str | None = None
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._capacity_dirty = asyncio.Event()
        self._changed = asyncio.Event()

    # -- what tests read ---------------------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    @property
    def allocations(self) -> Mapping[ContainerKey, ContainerAllocation]:
        """What each container of a live pod received, by ``(namespace, pod, container)``."""
        return MappingProxyType(self._allocations)

    def devices(self, resource: str) -> tuple[PluginDevice, ...]:
        """The devices of `resource` as its plugin last listed them, in ID order."""
        return tuple(sorted(self._devices.get(resource, {}).values(), key=lambda d: d.id))

    def connected(self, resource: str) -> bool:
        """Whether a plugin for `resource` is registered and its ``ListAndWatch`` stream is open."""
        endpoint = self._endpoints.get(resource)
        return endpoint is not None and endpoint.connected

    async def wait_until(
        self, predicate: Callable[[], T | None], *, timeout_s: float = 30.0, what: str = ""
    ) -> T:
        """Return `predicate`'s first truthy value, re-checked whenever the stand-in's state changes."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    changed = self._changed
                    result = predicate()
                    if result:
                        return result
                    await changed.wait()
        except TimeoutError:
            raise WaitTimeout(
                f"kubelet stand-in: timed out after {timeout_s:g}s waiting for {what or predicate!r}; "
                f"registered: {dict(self.registrations)}, allocated: {sorted(self._allocations)}, "
                f"errors: {self.errors!r}"
            ) from None

    async def wait_allocated(
        self, namespace: str, pod: str, container: str, *, timeout_s: float = 30.0
    ) -> ContainerAllocation:
        """Wait until container `namespace/pod/container` has received its devices; return them."""
        key = ContainerKey(namespace, pod, container)
        return await self.wait_until(
            lambda: self._allocations.get(key), timeout_s=timeout_s, what=f"an allocation for {key}"
        )

    async def wait_registered(self, resource: str, *, times: int = 1, timeout_s: float = 30.0) -> int:
        """Wait until `resource` has registered `times` times in all, is connected and has listed its
        devices; return the count."""
        return await self.wait_until(
            lambda: self.registrations[resource] if self._registered(resource, times) else 0,
            timeout_s=timeout_s,
            what=f"{resource} registered {times} time(s)",
        )

    def _registered(self, resource: str, times: int) -> bool:
        endpoint = self._endpoints.get(resource)
        return (
            self.registrations[resource] >= times
            and endpoint is not None
            and endpoint.connected
            and endpoint.listed
        )

    # -- NodeAgent --------------------------------------------------------------------------------

    async def start(self, node: SimulatedNode) -> None:
        """Start serving for `node` (the `NodeAgent` hook: called once the node is Ready)."""
        if self._node is not None:
            raise RuntimeError(f"KubeletStandIn.start: already running for node {self._node.name!r}")
        self._node = node
        try:
            await self._serve()
        except BaseException:
            await self._shutdown()
            self._node = None
            raise

    async def stop(self) -> None:
        """Stop everything: tasks, the registration server, plugin channels, ``kubelet.sock``."""
        if self._node is None:
            return
        await self._shutdown()
        self._node = None

    async def restart(self) -> None:
        """A kubelet restart: stop, delete the sockets, serve again; allocations so far are kept."""
        if self._node is None:
            raise RuntimeError("KubeletStandIn.restart: not started")
        await self._shutdown()
        self.restarts += 1
        await self._serve()

    async def _serve(self) -> None:
        node = self._require_node()
        removed = await asyncio.to_thread(self._prepare_dir)
        if removed:
            log.info("kubelet stand-in %s: removed stale sockets %s", node.name, removed)
        server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        await server.start()
        self._server = server
        self._queue = asyncio.Queue()
        self._seen.clear()
        feed = _PodFeed()
        self._spawn(self._pod_informer(feed).run(), "pods-watch")
        self._spawn(self._apply_pod_events_forever(feed), "pods")
        self._spawn(self._admit_pods_forever(), "admit")
        self._spawn(self._report_capacity_forever(), "capacity")
        if self._devices:
            self._capacity_dirty.set()
        log.info("kubelet stand-in %s: serving %s", node.name, self.socket_path)
        self._notify()

    def _prepare_dir(self) -> list[str]:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        self.pod_resources_socket.unlink(missing_ok=True)
        if self.record_dir is not None:
            self.record_dir.mkdir(parents=True, exist_ok=True)
        return _remove_sockets(self.plugin_dir)

    async def _shutdown(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=None)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for endpoint in self._endpoints.values():
            endpoint.connected = False
            await endpoint.channel.close()
        self._pods.clear()
        self.socket_path.unlink(missing_ok=True)
        self.pod_resources_socket.unlink(missing_ok=True)
        self._notify()

    def _require_node(self) -> SimulatedNode:
        if self._node is None:
            raise RuntimeError("KubeletStandIn: not started")
        return self._node

    # -- tasks ------------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        name = self._node.name if self._node is not None else "?"
        task = asyncio.create_task(coro, name=f"kubelet-standin:{name}:{what}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("kubelet stand-in task %s failed", task.get_name(), exc_info=exc)
            self.errors.append(exc)
            self._notify()

    def _notify(self) -> None:
        """Wake every `wait_until`: the state they look at may have changed."""
        self._changed.set()
        self._changed = asyncio.Event()

    # -- registration and device lists --------------------------------------------------------------

    async def _register(
        self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        resource, endpoint = request.resource_name, request.endpoint
        log.info(
            "kubelet stand-in: registration of %s at %s (version %s)", resource, endpoint, request.version
        )
        if request.version != VERSION:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"requested API version {json.dumps(request.version)} is not supported by kubelet. "
                f'Supported versions are ["{VERSION}"]',
            )
        if not is_extended_resource_name(resource):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"the ResourceName {json.dumps(resource)} is invalid"
            )
        if not endpoint or "/" in endpoint or endpoint in (".", ".."):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"endpoint {json.dumps(endpoint)} must be a socket name in {self.plugin_dir}",
            )
        path = self.plugin_dir / endpoint
        channel = grpc.aio.insecure_channel(f"unix://{path}")
        installed = False
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout=self.settings.dial_timeout_s)
                stub = api_pb2_grpc.DevicePluginStub(channel)
                options = await stub.GetDevicePluginOptions(
                    api_pb2.Empty(), timeout=self.settings.plugin_call_timeout_s
                )
            except TimeoutError:
                waited = self.settings.dial_timeout_s
                message = f"failed to dial device plugin {resource} at {path}: no answer in {waited:g}s"
                await context.abort(grpc.StatusCode.UNAVAILABLE, message)
            except grpc.aio.AioRpcError as exc:
                message = (
                    f"device plugin {resource} at {path}: GetDevicePluginOptions failed: {_rpc_error(exc)}"
                )
                await context.abort(grpc.StatusCode.UNAVAILABLE, message)
            await self._install(_Endpoint(resource, path, channel, stub, options))
            installed = True
        finally:
            if not installed:
                await channel.close()

    async def _install(self, endpoint: _Endpoint) -> None:
        old = self._endpoints.get(endpoint.resource)
        self._endpoints[endpoint.resource] = endpoint
        self._devices.setdefault(endpoint.resource, {})
        self.registrations[endpoint.resource] += 1
        endpoint.task = self._spawn(self._list_and_watch(endpoint), f"listandwatch:{endpoint.resource}")
        log.info(
            "kubelet stand-in: %s registered (%s), options %s",
            endpoint.resource,
            endpoint.socket,
            {
                "pre_start_required": endpoint.options.pre_start_required,
                "get_preferred_allocation_available": endpoint.options.get_preferred_allocation_available,
            },
        )
        self._capacity_dirty.set()
        self._notify()
        if old is not None:
            old.connected = False
            if old.task is not None:
                old.task.cancel()
                await asyncio.wait([old.task])
            await old.channel.close()

    async def _list_and_watch(self, endpoint: _Endpoint) -> None:
        # The stream lasts as long as the plugin: it has no deadline (nor has the kubelet's).
        call = endpoint.stub.ListAndWatch(api_pb2.Empty())
        try:
            async for response in call:
                if self._endpoints.get(endpoint.resource) is not endpoint:
                    break
                self._devices[endpoint.resource] = {
                    d.ID: PluginDevice(d.ID, d.health == HEALTHY, tuple(n.ID for n in d.topology.nodes))
                    for d in response.devices
                }
                endpoint.listed = True
                self._capacity_dirty.set()
                self._notify()
            log.warning("kubelet stand-in: ListAndWatch of %s ended", endpoint.resource)
        except grpc.aio.AioRpcError as exc:
            log.warning("kubelet stand-in: ListAndWatch of %s failed: %s", endpoint.resource, _rpc_error(exc))
        finally:
            call.cancel()
            if self._endpoints.get(endpoint.resource) is endpoint and endpoint.connected:
                # Until the plugin registers again its devices count as unhealthy.
                endpoint.connected = False
                self._capacity_dirty.set()
                self._notify()

    async def _report_capacity_forever(self) -> None:
        node = self._require_node()
        backoff = self.settings.first_backoff_s
        while True:
            await self._capacity_dirty.wait()
            self._capacity_dirty.clear()
            connected = {r for r, e in self._endpoints.items() if e.connected}
            capacity, allocatable = node_resources(
                {r: devs.values() for r, devs in self._devices.items()}, connected
            )
            try:
                await node.set_capacity(capacity, allocatable)
                backoff = self.settings.first_backoff_s
            except Exception as exc:
                log.warning("kubelet stand-in %s: capacity not reported (%s); retrying", node.name, exc)
                self._capacity_dirty.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.settings.max_backoff_s)

    # -- pods: list + watch -----------------------------------------------------------------------

    def _kube(self) -> KubeApi:
        return self._require_node().kube

    def _pod_informer(self, feed: _PodFeed) -> Informer:
        """The pods bound to this node, listed and watched by ``hamipy.kube.informer``."""
        node = self._require_node()
        s = self.settings
        informer = Informer(
            self._kube(),
            pod_path(),
            logger=_StdlibLogger(f"kubelet stand-in {node.name}: pods"),
            query=node_pods_query(node.name),
            settings=InformerSettings(
                page_size=s.list_page_size,
                list_timeout_s=API_TIMEOUT_S,
                watch_timeout_s=s.watch_timeout_s,
                inactivity_s=s.watch_inactivity_s,
                first_backoff_s=s.first_backoff_s,
                max_backoff_s=s.max_backoff_s,
            ),
            keep=False,  # the stand-in keeps its own `_pods`
        )
        informer.subscribe(feed)
        return informer

    async def _apply_pod_events_forever(self, feed: _PodFeed) -> None:
        """Apply what the informer told, in its order (one at a time: freeing devices and deleting
        a pod are awaited before the next event)."""
        while True:
            kind, payload = await feed.events.get()
            if kind == "LISTED":
                await self._on_listed(payload)
            elif kind == "DELETED":
                await self._forget(str((payload.get("metadata") or {}).get("uid", "")))
            else:
                await self._on_pod(payload)
            feed.events.task_done()  # `feed.events.join()`: everything told so far is applied

    async def _on_listed(self, items: list[dict[str, Any]]) -> None:
        listed = {str(p["metadata"]["uid"]) for p in items}
        # Pods that went while nobody watched (e.g. during a restart) free their devices.
        for uid in [*self._pods, *self._by_pod]:
            if uid not in listed:
                await self._forget(uid)
        # A kubelet admits a batch of pods in creation order.
        for pod in sorted(
            items,
            key=lambda p: (
                str(p["metadata"].get("creationTimestamp") or ""),
                str(p["metadata"].get("namespace") or ""),
                str(p["metadata"].get("name") or ""),
            ),
        ):
            await self._on_pod(pod)

    async def _on_pod(self, pod: dict[str, Any]) -> None:
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if not uid:
            return
        if pod_is_deleting(pod):
            await self._forget(uid)
            await self._finish_deletion(pod)
            return
        if pod_is_terminal(pod):
            await self._forget(uid)
            return
        self._pods[uid] = pod
        if uid not in self._seen and uid not in self._served:
            self._seen.add(uid)
            self._queue.put_nowait(uid)

    async def _forget(self, uid: str) -> None:
        """The pod is gone or done: drop it and free its devices."""
        self._pods.pop(uid, None)
        self._seen.discard(uid)
        self._served.discard(uid)
        self._rejected.discard(uid)
        await self._free(uid)

    async def _finish_deletion(self, pod: dict[str, Any]) -> None:
        """Remove a pod marked for deletion at once, as a kubelet does once its containers stopped."""
        meta = pod["metadata"]
        try:
            await self._kube().request(
                "DELETE",
                pod_path(meta["namespace"], meta["name"]),
                # With a body the apiserver reads the options only from it, not the query.
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
            )
        except (NotFound, Conflict):
            pass  # gone already, or a new pod of that name
        except KubeError as exc:
            log.warning("kubelet stand-in: %s", exc)

    # -- pods: admission --------------------------------------------------------------------------

    async def _admit_pods_forever(self) -> None:
        while True:
            uid = await self._queue.get()
            pod = self._pods.get(uid)
            if pod is None or uid in self._served:
                continue
            self._admitting = uid
            try:
                await self._admit(uid, pod)
            except Exception as exc:
                meta = pod["metadata"]
                log.exception("kubelet stand-in: pod %s/%s not served", meta["namespace"], meta["name"])
                self.errors.append(exc)
                self._notify()
            finally:
                self._admitting = None

    async def _admit(self, uid: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
        containers: list[ContainerRequest] = []
        try:
            containers = container_requests(pod.get("spec") or {}, set(self._devices))
            reusable: dict[str, set[str]] = {}
            for container in containers:
                key = ContainerKey(namespace, name, container.name)
                done = self._allocations.get(key)
                if done is None or done.pod_uid != uid:
                    done = await self._allocate_container(uid, key, container, reusable)
                if done is not None:
                    release_reusable(
                        reusable, container.kind, {r.resource: r.device_ids for r in done.resources}
                    )
        except AdmissionError as exc:
            message = admission_message(str(exc))
            log.info("kubelet stand-in: pod %s/%s rejected: %s", namespace, name, message)
            await self._free(uid)
            self._served.add(uid)
            self._rejected.add(uid)
            await self._post_status(pod, rejected_status(message))
            return
        self._served.add(uid)
        if uid not in self._pods:  # deleted or finished while being admitted
            await self._free(uid)
            return
        for container in containers:
            failure = await self._pre_start(ContainerKey(namespace, name, container.name))
            if failure:
                log.warning(
                    "kubelet stand-in: %s/%s %s not started: %s", namespace, name, container.name, failure
                )
                await self._post_status(pod, waiting_status(container, failure))
                return
        now = datetime.datetime.now(datetime.UTC)
        await self._post_status(pod, running_status(pod, containers, now=now, host_ip=_HOST_IP))

    async def _allocate_container(
        self, uid: str, key: ContainerKey, container: ContainerRequest, reusable: dict[str, set[str]]
    ) -> ContainerAllocation | None:
        parts: list[ResourceAllocation] = []
        for resource, count in sorted(container.resources.items()):
            ids = await self._choose(resource, count, reusable.get(resource, set()))
            response = await self._allocate(resource, ids)
            parts.append(ResourceAllocation.from_response(resource, ids, response))
        if not parts:
            return None
        allocation = ContainerAllocation(
            namespace=key.namespace,
            pod=key.pod,
            pod_uid=uid,
            container=key.container,
            kind=container.kind,
            resources=tuple(parts),
        )
        await self._record(allocation)
        return allocation

    def _held(self, resource: str) -> set[str]:
        return {
            d
            for a in self._allocations.values()
            for r in a.resources
            if r.resource == resource
            for d in r.device_ids
        }

    async def _choose(self, resource: str, count: int, reusable: set[str]) -> tuple[str, ...]:
        endpoint = self._endpoints.get(resource)
        devices = self._devices.get(resource, {}).values() if self.connected(resource) else ()
        choice = begin_choice(
            resource, count, reusable=reusable, free=free_devices(devices, self._held(resource))
        )
        if choice.needed == 0 or endpoint is None:
            return finish_choice(choice)
        preferred: tuple[str, ...] = ()
        if endpoint.options.get_preferred_allocation_available:
            available, must_include, size = choice.preference_request()
            request = api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=must_include,
                        allocation_size=size,
                    )
                ]
            )
            try:
                answer = await endpoint.stub.GetPreferredAllocation(
                    request, timeout=self.settings.plugin_call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                raise AdmissionError(
                    f"device plugin GetPreferredAllocation rpc failed with err: {_rpc_error(exc)}"
                ) from exc
            if answer.container_responses:
                preferred = tuple(answer.container_responses[0].deviceIDs)
        return finish_choice(choice, preferred)

    async def _allocate(self, resource: str, ids: tuple[str, ...]) -> api_pb2.ContainerAllocateResponse:
        endpoint = self._endpoints.get(resource)
        if endpoint is None or not endpoint.connected:
            raise AdmissionError(f"unknown Device Plugin {resource}")
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
        )
        try:
            response = await endpoint.stub.Allocate(request, timeout=self.settings.plugin_call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise AdmissionError(_rpc_error(exc)) from exc
        if not response.container_responses:
            raise AdmissionError("no containers return in allocation response")
        return response.container_responses[0]

    async def _pre_start(self, key: ContainerKey) -> str:
        """Call ``PreStartContainer`` where the plugin asks for it; return an error text or ``""``."""
        allocation = self._allocations.get(key)
        for part in allocation.resources if allocation is not None else ():
            endpoint = self._endpoints.get(part.resource)
            if endpoint is None or not endpoint.connected:
                return f"endpoint not found in cache for a registered resource: {part.resource}"
            if not endpoint.options.pre_start_required:
                continue
            request = api_pb2.PreStartContainerRequest(devices_ids=part.device_ids)
            try:
                await endpoint.stub.PreStartContainer(request, timeout=self.settings.plugin_call_timeout_s)
            except grpc.aio.AioRpcError as exc:
                return f"device plugin PreStartContainer rpc failed with err: {_rpc_error(exc)}"
        return ""

    async def _post_status(self, pod: dict[str, Any], body: dict[str, Any]) -> None:
        meta = pod["metadata"]
        path = f"{pod_path(meta['namespace'], meta['name'])}/status"
        backoff = self.settings.first_backoff_s
        for attempt in range(1, self.settings.status_attempts + 1):
            try:
                await self._kube().request("PATCH", path, body=body, content_type=STRATEGIC_MERGE_PATCH)
                return
            except NotFound:
                return
            except KubeError as exc:
                # A refusal (4xx) stays one; an unreachable or failing apiserver (0, 5xx) is retried.
                if attempt == self.settings.status_attempts or 400 <= exc.status < 500:
                    raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.max_backoff_s)

    # -- the PodResources API ---------------------------------------------------------------------

    def pod_resources(self) -> podresources_pb2.ListPodResourcesResponse:
        """``List``: the pods admitted and not rejected, and the pod being admitted."""
        active = [
            (uid, pod)
            for uid, pod in self._pods.items()
            if (uid in self._served and uid not in self._rejected) or uid == self._admitting
        ]
        response = podresources_pb2.ListPodResourcesResponse()
        for uid, pod in active:
            meta = pod["metadata"]
            namespace, name = str(meta["namespace"]), str(meta["name"])
            entry = response.pod_resources.add(name=name, namespace=namespace)
            for container in _listed_containers(pod):
                listed = entry.containers.add(name=container)
                held = self._allocations.get(ContainerKey(namespace, name, container))
                for part in held.resources if held is not None and held.pod_uid == uid else ():
                    listed.devices.add(resource_name=part.resource, device_ids=part.device_ids)
        return response

    # -- the record -------------------------------------------------------------------------------

    def _record_path(self, key: ContainerKey) -> Path | None:
        if self.record_dir is None:
            return None
        # Namespaces, pod and container names never contain "_", so the name is unambiguous.
        return self.record_dir / f"{key.namespace}_{key.pod}_{key.container}.json"

    async def _record(self, allocation: ContainerAllocation) -> None:
        # The file first, so that whoever sees the allocation in memory also finds its file.
        path = self._record_path(allocation.key)
        if path is not None:
            try:
                await asyncio.to_thread(_write_json, path, allocation.to_json())
            except OSError as exc:
                log.warning("kubelet stand-in: allocation record %s not written: %s", path, exc)
        self._allocations[allocation.key] = allocation
        self._by_pod.setdefault(allocation.pod_uid, []).append(allocation.key)
        self._notify()

    async def _free(self, uid: str) -> None:
        keys = [k for k in self._by_pod.get(uid, []) if (a := self._allocations.get(k)) and a.pod_uid == uid]
        # The files first, so that once the devices show as free the records are gone too.
        for key in keys:
            path = self._record_path(key)
            if path is not None:
                await asyncio.to_thread(path.unlink, missing_ok=True)
        for key in keys:
            if (held := self._allocations.get(key)) is not None and held.pod_uid == uid:
                del self._allocations[key]
        if self._by_pod.pop(uid, None) is not None:
            self._notify()
