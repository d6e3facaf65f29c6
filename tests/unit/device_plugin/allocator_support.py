"""Waiting pods as our scheduler (or a tenant forging its annotations) leaves them, and an
``Allocator`` over a ``FakeKube`` with the pods listed, for the serving-rule and preference tests."""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import builders
import grpc
import grpc.aio
import pytest
from fake_kube import FakeKube
from plugin_fakes import NODE, PODS, FakePodResources, log_lines

from hamipy.device_plugin.allocating import ServeRules
from hamipy.device_plugin.allocator import Allocator
from hamipy.device_plugin.devices import Gpu
from hamipy.device_plugin.inventory import Inventory
from hamipy.device_plugin.kube import NodeKube, node_pods_informer
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.servicer import DevicePluginServicer
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.informer import InformerSettings
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc
from hamipy.protocol import ContainerDevice, keys
from hamipy.protocol.config import Config, load_config

UUID_A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-4000-8000-000000000000"
UUID_C = "GPU-cccccccc-0000-4000-8000-000000000000"
UUIDS = (UUID_A, UUID_B, UUID_C)
DEVMEM = 81920
"""Every GPU's registered memory here (MiB)."""
SPLIT = 10
DEVICE_IDS = tuple(f"{uuid}-{i}" for uuid in UUIDS for i in range(SPLIT))
"""The fake device IDs the plugin advertises in these tests."""
RULES = ServeRules(devmem=dict.fromkeys(UUIDS, DEVMEM))


def dev(uuid: str, mem: int = 1000, cores: int = 10) -> ContainerDevice:
    return ContainerDevice(uuid, "NVIDIA", mem, cores)


def waiting_pod(
    name: str,
    *containers: dict[str, Any],
    slots: Sequence[Sequence[ContainerDevice]],
    init: Sequence[dict[str, Any]] = (),
    scheduler: str | None = "hami-scheduler",
    bind_time: int = 1,
) -> dict[str, Any]:
    """``builders.allocating_pod`` on NODE with all of ``slots`` still to serve, one per container,
    init containers first (or fewer, as HAMi's scheduler writes them)."""
    return builders.allocating_pod(
        name,
        *containers,
        node=NODE,
        allocated=slots,
        to_allocate=slots,
        init=init,
        bind_time=bind_time,
        scheduler_name=scheduler,
    )


def hijack_pod(name: str = "hijack", *, bind_time: int = 1) -> dict[str, Any]:
    """A tenant's pod that asks for no GPU (the webhook never sees it), bound by ``spec.nodeName``
    with allocation annotations naming a 1 MiB, 0-core slice of GPU A: the hijack, which must not
    be what the next GPU container on the node is served."""
    return waiting_pod(
        name,
        builders.container("main"),
        slots=[[dev(UUID_A, mem=1, cores=0)]],
        scheduler="default-scheduler",
        bind_time=bind_time,
    )


def legit_pod(name: str = "legit", *, bind_time: int = 2) -> dict[str, Any]:
    """A pod our scheduler placed: 30000 MiB and 40 % of GPU B."""
    return waiting_pod(
        name,
        builders.container("main", gpu=1, gpumem=30000, gpucores=40),
        slots=[[dev(UUID_B, mem=30000, cores=40)]],
        bind_time=bind_time,
    )


def recording_pod_patches(api: FakeKube, watched: Path) -> list[bool]:
    """Whether the file ``watched`` is there, at each of ``api``'s pod patches."""
    seen: list[bool] = []

    def record(method: str, path: str, body: Any) -> None:
        if method == "PATCH" and "/pods/" in path:
            seen.append(watched.is_file())

    api.on_request = record
    return seen


def annotations_of(api: FakeKube, name: str) -> dict[str, str]:
    result: dict[str, str] = api.pod("ns", name)["metadata"]["annotations"]
    return result


def phase_of(api: FakeKube, name: str) -> str:
    return annotations_of(api, name)[keys.BIND_PHASE]


def logged(log: io.StringIO, event: str) -> list[dict[str, Any]]:
    return [line for line in log_lines(log) if line["event"] == event]


async def make_allocator(
    api: FakeKube,
    tmp_path: Path,
    *,
    log: io.StringIO | None = None,
    rules: ServeRules = RULES,
    device_ids: Callable[[], Collection[str]] | None = lambda: DEVICE_IDS,
    kubelet: FakePodResources | None = None,
    strategy: str = "envvar",
) -> Allocator:
    """An allocator for NODE over ``api``, its pod cache listed once (``api``'s log cleared after),
    asking ``kubelet`` (default: a kubelet admitting ``api``'s pods in bind order) which pod is
    admitted, answering in the device list ``strategy`` (CDI specs in ``<tmp_path>/cdi``)."""
    config = load_config(
        f"nvidia:\n  hookPath: {tmp_path}/vgpu\n  deviceListStrategy: {strategy}\n"
        f"  cdiSpecDir: {tmp_path}/cdi\n"
    )
    telemetry = Telemetry.create(stream=log or io.StringIO())
    cache = PodCache(node_pods_informer(api, NODE, logger=telemetry.logger, settings=InformerSettings()))
    await cache.informer.list_once()
    lists = {r.query.get("fieldSelector") for r in api.requests if r.path == PODS}
    assert lists == {f"spec.nodeName={NODE}"}, "its node's pods only"
    api.requests.clear()
    return Allocator(
        api=NodeKube(api, node_name=NODE),
        pods=cache,
        kubelet=(kubelet or FakePodResources(api)).pods,
        nvidia=config.nvidia,
        node_settings=config.for_node(NODE),
        telemetry=telemetry,
        rules=rules,
        device_ids=device_ids,
        cache_id=lambda: "c0ffee",
    )


@contextlib.asynccontextmanager
async def plugin_stub(allocator: Allocator) -> AsyncIterator[api_pb2_grpc.DevicePluginAsyncStub]:
    """The plugin's gRPC service over ``allocator`` (and GPUs A, B and C) on a unix socket, and a
    client of it, as the kubelet has."""
    gpus = [Gpu(i, uuid, "NVIDIA A100", DEVMEM, 0, f"0000000{i}:10:00.0") for i, uuid in enumerate(UUIDS)]
    settings = Config().for_node(NODE)
    servicer = DevicePluginServicer(
        inventory=Inventory(gpus, settings), allocator=allocator, telemetry=allocator.telemetry
    )
    server = grpc.aio.server()
    api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)
    # Not tmp_path: a unix socket's path must stay under 108 bytes.
    folder = Path(tempfile.mkdtemp(prefix="hdp-", dir="/tmp"))
    server.add_insecure_port(f"unix://{folder}/plugin.sock")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{folder}/plugin.sock") as channel:
            yield api_pb2_grpc.DevicePluginStub(channel)
    finally:
        await server.stop(None)
        shutil.rmtree(folder, ignore_errors=True)


def allocate_request(*ids: str) -> api_pb2.AllocateRequest:
    """An Allocate of one container with the device IDs ``ids``, as the kubelet sends it."""
    return api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)])


async def refused_over_grpc(allocator: Allocator, *ids: str) -> grpc.aio.AioRpcError:
    """The error the plugin's gRPC service answers an Allocate of ``ids`` with."""
    async with plugin_stub(allocator) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Allocate(allocate_request(*ids), timeout=10)
    return caught.value
