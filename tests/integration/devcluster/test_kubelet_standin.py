"""The kubelet stand-in drives a real device plugin over gRPC and reports to the real API server.

The plugin here is a small real one: it serves ``DevicePlugin`` on its own socket, registers on
``kubelet.sock``, streams four devices, prefers the highest IDs, and registers again when its
socket vanishes (as a real plugin does after a kubelet restart).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import builders
import grpc
import grpc.aio
import pytest
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from hamipy.devcluster import (
    API_TIMEOUT_S,
    ContainerKey,
    KubeletStandIn,
    NodePool,
    NodeSpec,
    PluginDevice,
    SimulatedNode,
    wait_for,
)
from hamipy.kubelet_api import HEALTHY, KUBELET_SOCKET, UNHEALTHY, VERSION
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc

pytestmark = pytest.mark.integration

RESOURCE = "example.com/gpu"
DEVICE_IDS = ("gpu-0", "gpu-1", "gpu-2", "gpu-3")
ENV = "FAKE_GPU_DEVICES"
MOUNT = "/usr/local/fake-gpu"
PLUGIN_OPTIONS = api_pb2.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)


class FakeDevicePlugin(api_pb2_grpc.DevicePluginServicer):
    """A device plugin for `RESOURCE` that records every call it gets."""

    def __init__(self, plugin_dir: Path, *, endpoint: str = "fake-gpu.sock") -> None:
        self.plugin_dir = plugin_dir
        self.endpoint = endpoint
        self.health = dict.fromkeys(DEVICE_IDS, HEALTHY)
        self.allocate_calls: list[tuple[str, ...]] = []
        self.preferred_calls: list[tuple[tuple[str, ...], tuple[str, ...], int]] = []
        self.prestart_calls: list[tuple[str, ...]] = []
        self.allocate_error = ""
        self.serves = 0
        self.registered = 0
        self._changed = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._watcher: asyncio.Task[None] | None = None

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.endpoint

    # -- DevicePlugin ---------------------------------------------------------------------------

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: Any
    ) -> api_pb2.DevicePluginOptions:
        return PLUGIN_OPTIONS

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: Any
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        while True:
            changed = self._changed
            yield api_pb2.ListAndWatchResponse(
                devices=[
                    api_pb2.Device(
                        ID=device,
                        health=health,
                        topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=0)]),
                    )
                    for device, health in sorted(self.health.items())
                ]
            )
            await changed.wait()

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: Any
    ) -> api_pb2.PreferredAllocationResponse:
        # Highest IDs first: a stand-in that ignored the preference would take the lowest.
        answers = []
        for r in request.container_requests:
            must = tuple(r.must_include_deviceIDs)
            self.preferred_calls.append((tuple(sorted(r.available_deviceIDs)), must, r.allocation_size))
            rest = sorted(set(r.available_deviceIDs) - set(must), reverse=True)
            answers.append(
                api_pb2.ContainerPreferredAllocationResponse(deviceIDs=[*must, *rest][: r.allocation_size])
            )
        return api_pb2.PreferredAllocationResponse(container_responses=answers)

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Any) -> api_pb2.AllocateResponse:
        if self.allocate_error:
            await context.abort(grpc.StatusCode.INTERNAL, self.allocate_error)
        answers = []
        for r in request.container_requests:
            ids = tuple(r.devices_ids)
            self.allocate_calls.append(ids)
            answers.append(
                api_pb2.ContainerAllocateResponse(
                    envs={ENV: ",".join(ids)},
                    mounts=[
                        api_pb2.Mount(container_path=MOUNT, host_path=str(self.plugin_dir), read_only=True)
                    ],
                )
            )
        return api_pb2.AllocateResponse(container_responses=answers)

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: Any
    ) -> api_pb2.PreStartContainerResponse:
        self.prestart_calls.append(tuple(request.devices_ids))
        return api_pb2.PreStartContainerResponse()

    # -- life -----------------------------------------------------------------------------------

    def set_health(self, device: str, health: str) -> None:
        self.health[device] = health
        self._changed.set()
        self._changed = asyncio.Event()

    async def start(self) -> None:
        await self._serve()
        await self._register()
        self._watcher = asyncio.create_task(
            self._reregister_when_socket_goes(), name="fake-device-plugin:watch"
        )

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.wait([self._watcher])
        if self._server is not None:
            await self._server.stop(grace=None)

    async def _serve(self) -> None:
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        self.serves += 1

    async def _register(self) -> None:
        async with grpc.aio.insecure_channel(f"unix://{self.plugin_dir / KUBELET_SOCKET}") as channel:
            request = api_pb2.RegisterRequest(
                version=VERSION, endpoint=self.endpoint, resource_name=RESOURCE, options=PLUGIN_OPTIONS
            )
            await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=10, wait_for_ready=True)
        self.registered += 1

    async def _reregister_when_socket_goes(self) -> None:
        # A real plugin watches the directory with inotify; checking its own socket is enough here.
        while True:
            await asyncio.sleep(0.05)
            if not self.socket_path.exists():
                assert self._server is not None
                await self._server.stop(grace=None)
                await self._serve()
                await self._register()


@dataclasses.dataclass
class Rig:
    namespace: str
    node: SimulatedNode
    standin: KubeletStandIn
    plugin: FakeDevicePlugin
    core: CoreV1Api
    record_dir: Path


@pytest.fixture
async def rig(kube_client: Any, namespace: str, node_pool: NodePool, tmp_path: Path) -> AsyncIterator[Rig]:
    # Socket paths must stay short (about 100 characters); pytest's tmp_path can be longer.
    plugin_dir = Path(tempfile.mkdtemp(prefix="hks-", dir="/tmp"))
    record_dir = tmp_path / "allocations"
    standin = KubeletStandIn(plugin_dir, record_dir=record_dir)
    node = await node_pool.add(NodeSpec(name=f"{namespace}-kubelet"), agents=(standin,))
    plugin = FakeDevicePlugin(plugin_dir)
    try:
        await plugin.start()
        await standin.wait_registered(RESOURCE, timeout_s=10)
        yield Rig(namespace, node, standin, plugin, CoreV1Api(kube_client), record_dir)
    finally:
        await plugin.stop()
        await node_pool.remove(node.name)
        shutil.rmtree(plugin_dir, ignore_errors=True)


def _pod(name: str, node: str, *, init: int | None = None, **containers: int) -> dict[str, Any]:
    """``builders.pod`` bound to ``node``: each container (and the init container ``setup``) asks
    for that many ``RESOURCE``."""

    def asking(cname: str, count: int) -> dict[str, Any]:
        return builders.container(cname, limits={RESOURCE: str(count)})

    setup = [asking("setup", init)] if init is not None else []
    return builders.pod(name, *(asking(c, n) for c, n in containers.items()), init=setup, node_name=node)


async def _create(rig: Rig, body: dict[str, Any]) -> None:
    core: Any = rig.core  # its hint asks for a V1Pod; the client sends a JSON body as it is
    await core.create_namespaced_pod(rig.namespace, body, _request_timeout=API_TIMEOUT_S)


async def _wait_phase(rig: Rig, name: str, phase: str, *, timeout_s: float = 20) -> Any:
    async def in_phase() -> Any:
        pod = await rig.core.read_namespaced_pod(name, rig.namespace, _request_timeout=API_TIMEOUT_S)
        return pod if pod.status.phase == phase else None

    return await wait_for(in_phase, timeout=timeout_s, what=f"pod {rig.namespace}/{name} to be {phase}")


async def _node_devices(rig: Rig) -> tuple[str | None, str | None]:
    node = await rig.core.read_node(rig.node.name, _request_timeout=API_TIMEOUT_S)
    return node.status.capacity.get(RESOURCE), node.status.allocatable.get(RESOURCE)


async def _wait_node_devices(rig: Rig, capacity: str, allocatable: str) -> None:
    async def reported() -> bool:
        return await _node_devices(rig) == (capacity, allocatable)

    await wait_for(
        reported, timeout=20, what=f"node {RESOURCE} capacity {capacity}, allocatable {allocatable}"
    )


def _held(rig: Rig) -> list[str]:
    return sorted(d for a in rig.standin.allocations.values() for d in a.device_ids)


def _flat(calls: Iterable[tuple[str, ...]]) -> list[str]:
    return [d for call in calls for d in call]


class TestRegistration:
    async def test_registered_devices_show_on_the_node(self, rig: Rig) -> None:
        await _wait_node_devices(rig, "4", "4")
        assert rig.standin.devices(RESOURCE) == tuple(PluginDevice(d, True, (0,)) for d in DEVICE_IDS)
        assert rig.plugin.registered == 1
        assert rig.standin.registrations[RESOURCE] == 1

    async def test_an_unhealthy_device_lowers_allocatable(self, rig: Rig) -> None:
        await _wait_node_devices(rig, "4", "4")

        rig.plugin.set_health("gpu-1", UNHEALTHY)

        await _wait_node_devices(rig, "4", "3")
        assert [d.id for d in rig.standin.devices(RESOURCE) if not d.healthy] == ["gpu-1"]
        rig.plugin.set_health("gpu-1", HEALTHY)
        await _wait_node_devices(rig, "4", "4")

    async def test_a_plugin_that_goes_away_leaves_nothing_allocatable(self, rig: Rig) -> None:
        await _wait_node_devices(rig, "4", "4")

        await rig.plugin.stop()

        await _wait_node_devices(rig, "4", "0")
        assert not rig.standin.connected(RESOURCE)

    @pytest.mark.parametrize(
        ("version", "resource", "complaint"),
        [
            ("v1alpha", RESOURCE, r'requested API version "v1alpha" is not supported'),
            (VERSION, "gpu", r'the ResourceName "gpu" is invalid'),
        ],
        ids=["wrong-version", "not-an-extended-resource"],
    )
    async def test_a_bad_registration_is_refused(
        self, rig: Rig, version: str, resource: str, complaint: str
    ) -> None:
        async with grpc.aio.insecure_channel(f"unix://{rig.standin.socket_path}") as channel:
            request = api_pb2.RegisterRequest(version=version, endpoint="x.sock", resource_name=resource)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert details is not None
        assert complaint.replace("\\", "") in details
        assert rig.standin.registrations[RESOURCE] == 1


class TestAdmission:
    async def test_init_container_is_allocated_first_and_the_pod_runs(self, rig: Rig) -> None:
        await _create(rig, _pod("two", rig.node.name, init=1, main=2))

        pod = await _wait_phase(rig, "two", "Running")

        setup = rig.standin.allocations[ContainerKey(rig.namespace, "two", "setup")]
        main = rig.standin.allocations[ContainerKey(rig.namespace, "two", "main")]
        # The init container first; the plugin's preference (highest IDs) is followed, and, as in
        # the kubelet, the app container reuses the device the finished init container gave back.
        assert rig.plugin.allocate_calls == [("gpu-3",), ("gpu-3", "gpu-2")]
        assert rig.plugin.preferred_calls == [(DEVICE_IDS, (), 1), (DEVICE_IDS, ("gpu-3",), 2)]
        assert rig.plugin.prestart_calls == rig.plugin.allocate_calls
        assert (setup.kind, setup.device_ids, setup.envs) == ("init", ("gpu-3",), {ENV: "gpu-3"})
        assert (main.kind, main.device_ids, main.envs) == ("app", ("gpu-3", "gpu-2"), {ENV: "gpu-3,gpu-2"})
        assert main.mounts == ((MOUNT, str(rig.standin.plugin_dir), True),)
        assert main.for_resource(RESOURCE).resource == RESOURCE

        conditions = {c.type: c.status for c in pod.status.conditions}
        assert {k: conditions[k] for k in ("Ready", "ContainersReady", "Initialized", "PodScheduled")} == {
            "Ready": "True",
            "ContainersReady": "True",
            "Initialized": "True",
            "PodScheduled": "True",
        }
        assert pod.status.container_statuses[0].state.running is not None
        assert pod.status.init_container_statuses[0].state.terminated.reason == "Completed"

        record = json.loads((rig.record_dir / f"{rig.namespace}_two_main.json").read_text())
        assert record["resources"][0]["device_ids"] == ["gpu-3", "gpu-2"]
        assert record["resources"][0]["envs"] == {ENV: "gpu-3,gpu-2"}
        assert rig.standin.errors == []

    async def test_pods_are_admitted_in_the_order_they_are_bound_and_never_share(self, rig: Rig) -> None:
        for name in ("first", "second", "third"):
            await _create(rig, _pod(name, rig.node.name, main=2))

        await _wait_phase(rig, "first", "Running")
        await _wait_phase(rig, "second", "Running")
        third = await _wait_phase(rig, "third", "Failed")

        first = rig.standin.allocations[ContainerKey(rig.namespace, "first", "main")]
        second = rig.standin.allocations[ContainerKey(rig.namespace, "second", "main")]
        assert (first.device_ids, second.device_ids) == (("gpu-3", "gpu-2"), ("gpu-1", "gpu-0"))
        assert third.status.reason == "UnexpectedAdmissionError"
        assert third.status.message == (
            "Pod was rejected: Allocate failed due to requested number of devices unavailable for "
            f"{RESOURCE}. Requested: 2, Available: 0, which is unexpected"
        )
        assert (rig.namespace, "third", "main") not in rig.standin.allocations
        assert len(rig.plugin.allocate_calls) == 2

    async def test_a_deleted_pod_frees_its_devices(self, rig: Rig) -> None:
        await _create(rig, _pod("all", rig.node.name, main=4))
        await _wait_phase(rig, "all", "Running")
        assert _held(rig) == list(DEVICE_IDS)

        # A graceful delete: the stand-in removes the pod once its (pretend) containers stopped.
        await rig.core.delete_namespaced_pod("all", rig.namespace, _request_timeout=API_TIMEOUT_S)

        await rig.standin.wait_until(lambda: not rig.standin.allocations, timeout_s=10, what="devices freed")
        assert not (rig.record_dir / f"{rig.namespace}_all_main.json").exists()

        async def gone() -> bool:
            try:
                await rig.core.read_namespaced_pod("all", rig.namespace, _request_timeout=API_TIMEOUT_S)
            except ApiException as exc:
                return exc.status == 404
            return False

        await wait_for(gone, timeout=10, what="the deleted pod to be removed")
        await _create(rig, _pod("next", rig.node.name, main=4))
        await _wait_phase(rig, "next", "Running")
        assert _held(rig) == list(DEVICE_IDS)

    async def test_a_pod_asking_more_than_there_is_fails(self, rig: Rig) -> None:
        await _create(rig, _pod("greedy", rig.node.name, main=5))

        pod = await _wait_phase(rig, "greedy", "Failed")

        assert pod.status.reason == "UnexpectedAdmissionError"
        assert f"unavailable for {RESOURCE}. Requested: 5, Available: 4" in pod.status.message
        assert rig.plugin.allocate_calls == []
        assert not rig.standin.allocations

    async def test_an_allocate_error_fails_the_pod_with_the_plugins_message(self, rig: Rig) -> None:
        rig.plugin.allocate_error = "no fake GPU for you"
        await _create(rig, _pod("refused", rig.node.name, main=1))

        pod = await _wait_phase(rig, "refused", "Failed")

        assert pod.status.reason == "UnexpectedAdmissionError"
        assert pod.status.message == (
            "Pod was rejected: Allocate failed due to rpc error: code = Internal desc = no fake GPU for you, "
            "which is unexpected"
        )
        assert not rig.standin.allocations


class TestRestart:
    async def test_restart_removes_sockets_the_plugin_registers_again_and_allocations_stay(
        self, rig: Rig
    ) -> None:
        await _create(rig, _pod("before", rig.node.name, main=2))
        await _wait_phase(rig, "before", "Running")
        before = rig.standin.allocations[ContainerKey(rig.namespace, "before", "main")]
        # Some other plugin's socket, left behind: a restarting kubelet deletes every socket.
        stale = rig.standin.plugin_dir / "stale.sock"
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(stale))

        await rig.standin.restart()

        assert not stale.exists()
        assert rig.standin.socket_path.exists()
        await rig.standin.wait_registered(RESOURCE, times=2, timeout_s=10)
        await wait_for(lambda: rig.plugin.registered == 2, timeout=10, what="the plugin's second Register")
        # The plugin served again only because its socket was deleted.
        assert rig.plugin.serves == 2
        assert rig.standin.allocations[ContainerKey(rig.namespace, "before", "main")] == before
        await _wait_node_devices(rig, "4", "4")

        await _create(rig, _pod("after", rig.node.name, main=2))
        await _create(rig, _pod("extra", rig.node.name, main=1))
        await _wait_phase(rig, "after", "Running")
        await _wait_phase(rig, "extra", "Failed")

        after = rig.standin.allocations[ContainerKey(rig.namespace, "after", "main")]
        assert set(after.device_ids).isdisjoint(before.device_ids)
        assert _held(rig) == list(DEVICE_IDS)
        assert _flat(rig.plugin.allocate_calls) == [*before.device_ids, *after.device_ids]
        assert rig.standin.errors == []
