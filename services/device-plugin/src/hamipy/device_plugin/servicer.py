"""The ``v1beta1.DevicePlugin`` gRPC service the kubelet calls (docs/wire-format.md#device-plugin-api)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from hamipy.device_plugin.allocator import Allocator, Preference
from hamipy.device_plugin.errors import AllocateError, UnknownDevice
from hamipy.device_plugin.inventory import Inventory
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kubelet_api import HEALTHY, UNHEALTHY
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc

__all__ = ["OPTIONS", "DevicePluginServicer"]

OPTIONS = api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    """Answers the kubelet from the inventory (devices) and the allocator (Allocate)."""

    def __init__(self, *, inventory: Inventory, allocator: Allocator, telemetry: Telemetry) -> None:
        self.inventory = inventory
        self.allocator = allocator
        self.telemetry = telemetry

    async def GetDevicePluginOptions(
        self,
        request: api_pb2.Empty,
        context: grpc.aio.ServicerContext[api_pb2.Empty, api_pb2.DevicePluginOptions],
    ) -> api_pb2.DevicePluginOptions:
        return OPTIONS

    def _devices(self) -> api_pb2.ListAndWatchResponse:
        devices = self.inventory.kubelet_devices()
        healthy = sum(d.healthy for d in devices)
        self.telemetry.metrics.devices.labels(health=HEALTHY).set(healthy)
        self.telemetry.metrics.devices.labels(health=UNHEALTHY).set(len(devices) - healthy)
        return api_pb2.ListAndWatchResponse(
            devices=[
                api_pb2.Device(
                    ID=d.id,
                    health=HEALTHY if d.healthy else UNHEALTHY,
                    topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=d.numa)]),
                )
                for d in devices
            ]
        )

    async def ListAndWatch(
        self,
        request: api_pb2.Empty,
        context: grpc.aio.ServicerContext[api_pb2.Empty, api_pb2.ListAndWatchResponse],
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        """The device list now, then again on every health change, until the kubelet hangs up."""
        seen = self.inventory.version
        while True:
            yield self._devices()
            seen = await self.inventory.wait_changed(seen)

    async def GetPreferredAllocation(
        self,
        request: api_pb2.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            api_pb2.PreferredAllocationRequest, api_pb2.PreferredAllocationResponse
        ],
    ) -> api_pb2.PreferredAllocationResponse:
        """IDs on the GPUs planned for the container in line; an empty answer (the kubelet then
        chooses) where there is none, never an error."""
        answers = await self.allocator.preferred(
            [
                Preference(list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size)
                for r in request.container_requests
            ]
        )
        return api_pb2.PreferredAllocationResponse(
            container_responses=[
                api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in answers
            ]
        )

    async def Allocate(
        self,
        request: api_pb2.AllocateRequest,
        context: grpc.aio.ServicerContext[api_pb2.AllocateRequest, api_pb2.AllocateResponse],
    ) -> api_pb2.AllocateResponse:
        try:
            allocations = await self.allocator.allocate(
                [list(c.devices_ids) for c in request.container_requests]
            )
        except UnknownDevice as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except AllocateError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return api_pb2.AllocateResponse(
            container_responses=[
                api_pb2.ContainerAllocateResponse(
                    envs=dict(a.envs),
                    mounts=[
                        api_pb2.Mount(
                            container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
                        )
                        for m in a.mounts
                    ],
                    cdi_devices=[api_pb2.CDIDevice(name=name) for name in a.cdi_devices],
                )
                for a in allocations
            ]
        )

    async def PreStartContainer(
        self,
        request: api_pb2.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[
            api_pb2.PreStartContainerRequest, api_pb2.PreStartContainerResponse
        ],
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()
