"""A device plugin that serves pods as HAMi's NVIDIA device plugin does, for the tests that run our
extender beside HAMi's components.

It speaks the real device plugin gRPC API to the kubelet (stand-in) and follows HAMi's plugin
(``pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go`` ``Allocate``, v2.x) in what matters
for correctness beside our extender:

- the pod it serves is the one **the node lock names** (``GetAllocatePodByNode``), whatever pod the
  kubelet is admitting; only without a lock, the first pod in a list of the node's pods that is
  ``bind-phase: allocating`` (``GetPendingPod``);
- each container request takes the next non-empty slot of ``hami.io/vgpu-devices-to-allocate``;
  a slot with another number of devices than the kubelet asks fails the pod
  (``bind-phase: failed``, the lock released) and the Allocate;
- the container gets ``NVIDIA_VISIBLE_DEVICES`` with the slot's UUIDs, and the slot is erased;
- once no slot is left: ``bind-phase: success`` and the node lock released.

It advertises ``devices`` device IDs (HAMi's split replicas) and needs no GPU. Not HAMi's: no
``CUDA_DEVICE_*`` variables, mounts or register annotation (the test writes that on the Node).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import builders
import grpc
import grpc.aio

from hamipy.devcluster.kubelet_standin import KubeletStandIn
from hamipy.devcluster.nodes import NamedNode, NodePool, NodeSpec
from hamipy.kube.client import KubeApi
from hamipy.kube.errors import NotFound
from hamipy.kube.node_lock import release_node_lock
from hamipy.kube.resources import get_node, get_pod, node_pods_query, patch_pod_annotations, pod_path
from hamipy.kubelet_api import HEALTHY, KUBELET_SOCKET, VERSION
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc
from hamipy.protocol import keys
from hamipy.protocol.devices import DeviceInfo
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_lock import parse_node_lock
from hamipy.protocol.pod_devices import clear_container_slot, decode_pod_devices, encode_pod_devices

SOCKET = "hami-like.sock"
TIMEOUT_S = 30.0
"""Every API call: as long as the kubelet waits for an Allocate, so a short API stall delays it."""


class AllocateFailed(Exception):
    pass


class HamiLikeDevicePlugin(api_pb2_grpc.DevicePluginServicer):
    """A `NodeAgent`: start it after the kubelet stand-in of the same ``plugin_dir``."""

    def __init__(self, api: KubeApi, plugin_dir: Path, *, devices: int, resource: str = keys.RESOURCE_COUNT):
        self.api = api
        self.plugin_dir = plugin_dir
        self.devices = devices
        self.resource = resource
        self.node = ""
        self.served: list[tuple[str, str, int]] = []
        """(pod, UUIDs, slot) in the order served."""
        self._server: grpc.aio.Server | None = None
        self._lock = asyncio.Lock()

    async def start(self, node: NamedNode) -> None:
        self.node = node.name
        socket = self.plugin_dir / SOCKET
        socket.unlink(missing_ok=True)
        self._server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{socket}")
        await self._server.start()
        async with grpc.aio.insecure_channel(f"unix://{self.plugin_dir / KUBELET_SOCKET}") as channel:
            await api_pb2_grpc.RegistrationStub(channel).Register(
                api_pb2.RegisterRequest(version=VERSION, endpoint=SOCKET, resource_name=self.resource),
                timeout=TIMEOUT_S,
            )

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: Any
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions()

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: Any
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        yield api_pb2.ListAndWatchResponse(
            devices=[api_pb2.Device(ID=f"hami-{i}", health=HEALTHY) for i in range(self.devices)]
        )
        await asyncio.Event().wait()  # until the kubelet hangs up

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: Any
    ) -> api_pb2.PreferredAllocationResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "not offered (GetPreferredAllocationAvailable false)"
        )
        raise AssertionError("unreachable: abort raises")

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: Any
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Any) -> api_pb2.AllocateResponse:
        async with self._lock:  # HAMi's plugin serves one Allocate at a time
            try:
                return await self._allocate(request)
            except AllocateFailed as exc:
                await context.abort(grpc.StatusCode.UNKNOWN, str(exc))
                raise  # unreachable: abort raises

    async def _allocate(self, request: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
        pod = await self._pending_pod()
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        annotations = meta.get("annotations") or {}
        try:
            slots = decode_pod_devices(annotations.get(keys.DEVICES_TO_ALLOCATE, ""))
        except ProtocolError as exc:
            await self._failed(namespace, name, uid)
            raise AllocateFailed(str(exc)) from exc
        responses = []
        for container in request.container_requests:
            slot = next((i for i, devices in enumerate(slots) if devices), None)
            if slot is None or len(slots[slot]) != len(container.devices_ids):
                await self._failed(namespace, name, uid)
                raise AllocateFailed("device number not matched")
            uuids = ",".join(d.uuid for d in slots[slot])
            self.served.append((f"{namespace}/{name}", uuids, slot))
            slots = clear_container_slot(slots, slot, field=keys.DEVICES_TO_ALLOCATE)
            responses.append(api_pb2.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": uuids}))
        remaining = encode_pod_devices(slots, field=keys.DEVICES_TO_ALLOCATE)
        done = not any(slots)
        update = {keys.DEVICES_TO_ALLOCATE: remaining, **({keys.BIND_PHASE: "success"} if done else {})}
        await patch_pod_annotations(self.api, namespace, name, uid, update, timeout_s=TIMEOUT_S)
        if done:
            await release_node_lock(self.api, self.node, namespace=namespace, name=name, timeout_s=TIMEOUT_S)
        return api_pb2.AllocateResponse(container_responses=responses)

    async def _pending_pod(self) -> dict[str, Any]:
        node = await get_node(self.api, self.node, timeout_s=TIMEOUT_S)
        value = (node["metadata"].get("annotations") or {}).get(keys.NODE_LOCK)
        if value:
            with contextlib.suppress(ProtocolError):
                lock = parse_node_lock(value)
                if lock.namespace and lock.name:
                    try:
                        return await get_pod(self.api, lock.namespace, lock.name, timeout_s=TIMEOUT_S)
                    except NotFound:
                        raise AllocateFailed(f"lock owner {lock.namespace}/{lock.name} not found") from None
        listed = await self.api.request(
            "GET", pod_path(), query=node_pods_query(self.node), timeout_s=TIMEOUT_S
        )
        for pod in listed["items"]:
            annotations = pod["metadata"].get("annotations") or {}
            if keys.BIND_TIME in annotations and annotations.get(keys.BIND_PHASE) == "allocating":
                return dict(pod)
        raise AllocateFailed(f"no binding pod found on node {self.node}")

    async def _failed(self, namespace: str, name: str, uid: str) -> None:
        failed = {keys.BIND_PHASE: "failed"}
        await patch_pod_annotations(self.api, namespace, name, uid, failed, timeout_s=TIMEOUT_S)
        await release_node_lock(self.api, self.node, namespace=namespace, name=name, timeout_s=TIMEOUT_S)


async def add_hami_node(
    pool: NodePool,
    api: KubeApi,
    name: str,
    devices: Sequence[DeviceInfo],
    *,
    labels: Mapping[str, str],
    plugin_dir: Path,
) -> tuple[KubeletStandIn, HamiLikeDevicePlugin]:
    """Node ``name`` registered as HAMi's device plugin registers it (no marker of ours), with the
    kubelet stand-in and a `HamiLikeDevicePlugin` offering every slot of ``devices``; returns once
    the plugin has registered. ``plugin_dir`` must be short (unix socket paths)."""
    standin = KubeletStandIn(plugin_dir)
    plugin = HamiLikeDevicePlugin(api, plugin_dir, devices=sum(d.count for d in devices))
    spec = NodeSpec(
        name=name, labels=dict(labels), annotations=builders.plugin_registration(devices, ours=False)
    )
    await pool.add(spec, agents=(standin, plugin))
    await standin.wait_registered(keys.RESOURCE_COUNT)
    return standin, plugin
