"""A device plugin in this process over a fake API, a fake kubelet and fake GPUs: readiness, and a
background task that dies (a bug in the pod watch, the health thread): logged by name, ``/readyz``
503 with the reason, ``run`` ending with it; a stop ends it cleanly; an Allocate on its socket asks
the kubelet's PodResources socket which pod it is admitting."""

from __future__ import annotations

import asyncio
import io
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import builders
import grpc
import grpc.aio
import pytest
from allocator_support import allocate_request
from fake_kube import FakeKube
from plugin_fakes import GPU_A, NODE, PODS, FakeHealth, FakeKubelet, log_lines, node_kube

from hamipy.devcluster import wait_for
from hamipy.device_plugin.plugin import DevicePlugin
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kubelet_api.podresources_v1 import api_pb2 as podresources_pb2
from hamipy.kubelet_api.podresources_v1 import api_pb2_grpc as podresources_pb2_grpc
from hamipy.kubelet_api.v1beta1 import api_pb2_grpc
from hamipy.protocol import keys
from hamipy.protocol.config import load_config
from hamipy.protocol.devices import ContainerDevice

DIED = "background task died; the service stops"
POD_RESOURCES = "pod-resources.sock"


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Not tmp_path: a unix socket's path must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="hdp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Plugin:
    plugin: DevicePlugin
    api: FakeKube
    log: io.StringIO
    health: list[FakeHealth]

    async def readyz(self) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.plugin.metrics_port}/readyz"
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(url) as resp,
        ):
            return resp.status, await resp.text()

    def died(self) -> list[dict[str, Any]]:
        return [e for e in log_lines(self.log) if e["event"] == DIED]


@pytest.fixture
def make_plugin(plugin_dir: Path, tmp_path: Path) -> Callable[..., Plugin]:
    def make(*, health_fails: BaseException | None = None, pods: Sequence[dict[str, Any]] = ()) -> Plugin:
        log = io.StringIO()
        api = node_kube(*pods)
        made: list[FakeHealth] = []

        def health_watch(
            uuids: list[str], on_unhealthy: Callable[[str, str], None], *, poll_s: float
        ) -> FakeHealth:
            watch = FakeHealth(uuids, on_unhealthy, poll_s=poll_s)
            watch.fail = health_fails
            made.append(watch)
            return watch

        plugin = DevicePlugin(
            config=load_config(f"nvidia:\n  hookPath: {tmp_path}/vgpu\n"),
            settings=PluginSettings(
                node_name=NODE,
                plugin_dir=plugin_dir,
                metrics_host="127.0.0.1",
                metrics_port=0,
                socket_check_interval_s=0.05,
                pod_resources_socket=plugin_dir / POD_RESOURCES,
            ),
            telemetry=Telemetry.create(stream=log),
            api=api,
            discover=lambda: [GPU_A],
            health_watch=health_watch,
        )
        return Plugin(plugin, api, log, made)

    return make


@pytest.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[FakeKubelet]:
    async with FakeKubelet(plugin_dir) as k:
        yield k


async def ready(p: Plugin) -> None:
    await wait_for(lambda: p.plugin.metrics_port is not None and p.plugin.not_ready() is None, timeout=10)


async def test_ready_once_registered_with_the_kubelet_and_the_node_and_pods_listed(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    p = make_plugin()
    async with p.plugin.running():
        await ready(p)
        assert await p.readyz() == (200, "ok")
        assert [r.resource_name for r in kubelet.registration.requests] == ["nvidia.com/gpu"]
        assert keys.NODE_REGISTER in p.api.node(NODE)["metadata"]["annotations"]
        assert (plugin_dir / "hamipy-nvidia.sock").exists()
    assert not (plugin_dir / "hamipy-nvidia.sock").exists(), "stopping removes the socket"
    assert p.died() == []


async def test_not_ready_says_what_it_waits_for(make_plugin: Callable[..., Plugin]) -> None:
    p = make_plugin()  # no kubelet: registration is retried
    async with p.plugin.running():
        await wait_for(lambda: p.plugin.pods.synced.is_set() and p.plugin.node_written.is_set(), timeout=10)
        assert await p.readyz() == (503, "not registered with the kubelet")


async def test_a_bug_in_the_pod_watch_fails_readiness_with_the_reason(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet
) -> None:
    p = make_plugin()
    async with p.plugin.running():
        await ready(p)
        p.api.send(PODS, TypeError("'NoneType' object is not subscriptable"))
        await asyncio.wait_for(p.plugin.supervisor.failed.wait(), timeout=10)
        reason = "task device-plugin:pod-informer died: TypeError: 'NoneType' object is not subscriptable"
        assert await p.readyz() == (503, reason)
    (line,) = p.died()
    assert (line["level"], line["task"]) == ("error", "device-plugin:pod-informer")
    assert line["error"] == "TypeError: 'NoneType' object is not subscriptable"


async def test_a_dead_task_ends_the_run_with_its_reason(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    p = make_plugin()
    p.api.send(PODS, TypeError("injected"))
    failure = await asyncio.wait_for(p.plugin.run(asyncio.Event()), timeout=10)
    assert failure == "task device-plugin:pod-informer died: TypeError: injected"
    assert [line["task"] for line in p.died()] == ["device-plugin:pod-informer"]
    assert not (plugin_dir / "hamipy-nvidia.sock").exists(), "the other tasks were stopped"
    assert p.health[0].stopped.is_set(), "the health thread was stopped"


async def test_a_health_thread_that_raises_ends_the_run(make_plugin: Callable[..., Plugin]) -> None:
    p = make_plugin(health_fails=RuntimeError("NVML handle went away"))
    failure = await asyncio.wait_for(p.plugin.run(asyncio.Event()), timeout=10)
    assert failure == "task device-plugin:health-watch died: RuntimeError: NVML handle went away"


async def test_stop_ends_the_run_without_a_failure(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet
) -> None:
    p = make_plugin()
    stop = asyncio.Event()
    run = asyncio.create_task(p.plugin.run(stop), name="test:plugin")
    await ready(p)
    stop.set()
    assert await asyncio.wait_for(run, timeout=10) is None
    assert p.died() == []
    assert p.health[0].stopped.is_set()


class _Admitting(podresources_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources ``List``: admitting ns/p, its container "main" without devices."""

    async def List(
        self,
        request: podresources_pb2.ListPodResourcesRequest,
        context: grpc.aio.ServicerContext[
            podresources_pb2.ListPodResourcesRequest, podresources_pb2.ListPodResourcesResponse
        ],
    ) -> podresources_pb2.ListPodResourcesResponse:
        return podresources_pb2.ListPodResourcesResponse(
            pod_resources=[
                podresources_pb2.PodResources(
                    namespace="ns", name="p", containers=[podresources_pb2.ContainerResources(name="main")]
                )
            ]
        )


async def test_an_allocate_asks_the_kubelets_pod_resources_socket(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    slots = [[ContainerDevice(GPU_A.uuid, "NVIDIA", 2000, 20)]]
    waiting = builders.allocating_pod(
        "p",
        builders.container("main", gpu=1, gpumem=2000, gpucores=20),
        node=NODE,
        allocated=slots,
        to_allocate=slots,
    )
    p = make_plugin(pods=[waiting])
    request = allocate_request(f"{GPU_A.uuid}-0")
    async with p.plugin.running():
        await ready(p)
        server = grpc.aio.server()
        podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(_Admitting(), server)
        server.add_insecure_port(f"unix://{plugin_dir / POD_RESOURCES}")
        await server.start()
        async with grpc.aio.insecure_channel(f"unix://{plugin_dir / 'hamipy-nvidia.sock'}") as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)
            try:
                response = await stub.Allocate(request, timeout=20)
            finally:
                await server.stop(None)
            # The kubelet's socket gone: refused, naming it.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Allocate(request, timeout=20)
    (answer,) = response.container_responses
    assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == GPU_A.uuid
    assert answer.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
    assert p.api.pod("ns", "p")["metadata"]["annotations"][keys.BIND_PHASE] == "success"
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"PodResources API at {plugin_dir / POD_RESOURCES} did not answer" in (
        caught.value.details() or ""
    )
