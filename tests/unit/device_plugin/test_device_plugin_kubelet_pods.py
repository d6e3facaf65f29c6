"""``PodResourcesClient`` against a real gRPC PodResources server on a unix socket, as the kubelet
serves it: the pods it lists, with our resource's device IDs per container; its rate limit waited
out; a kubelet that is not there, refuses, or does not answer in time is ``KubeletUnreachable``."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from hamipy.device_plugin.allocating import KubeletPod
from hamipy.device_plugin.errors import KubeletUnreachable
from hamipy.device_plugin.kubelet_pods import PodResourcesClient
from hamipy.kubelet_api.podresources_v1 import api_pb2, api_pb2_grpc

GPU = "nvidia.com/gpu"


class Lister(api_pb2_grpc.PodResourcesListerServicer):
    """``List`` answering ``answer``, after failing with each of ``errors`` in turn; ``stalled``:
    never answers."""

    def __init__(self) -> None:
        self.answer = api_pb2.ListPodResourcesResponse()
        self.errors: list[grpc.StatusCode] = []
        self.refuse_all: grpc.StatusCode | None = None
        self.stalled = False
        self.calls = 0

    async def List(
        self,
        request: api_pb2.ListPodResourcesRequest,
        context: grpc.aio.ServicerContext[api_pb2.ListPodResourcesRequest, api_pb2.ListPodResourcesResponse],
    ) -> api_pb2.ListPodResourcesResponse:
        self.calls += 1
        code = self.errors.pop(0) if self.errors else self.refuse_all
        if code is not None:
            await context.abort(code, f"the fake kubelet says {code.name}")
        if self.stalled:
            await asyncio.Event().wait()
        return self.answer


@pytest.fixture
async def socket_dir() -> AsyncIterator[Path]:
    # Not tmp_path: a unix socket's path must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="hpr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def serve(servicer: Lister, socket: Path) -> grpc.aio.Server:
    """The kubelet's PodResources server on ``socket``, started."""
    server = grpc.aio.server()
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    return server


@pytest.fixture
async def lister(socket_dir: Path) -> AsyncIterator[Lister]:
    servicer = Lister()
    server = await serve(servicer, socket_dir / "kubelet.sock")
    yield servicer
    await server.stop(None)


@contextlib.asynccontextmanager
async def connected(socket: Path, *, timeout_s: float = 5) -> AsyncIterator[PodResourcesClient]:
    """A client of the PodResources API on ``socket``, closed after."""
    client = PodResourcesClient(socket, GPU, timeout_s=timeout_s)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def client(socket_dir: Path) -> AsyncIterator[PodResourcesClient]:
    async with connected(socket_dir / "kubelet.sock") as made:
        yield made


def container(name: str, *groups: tuple[str, list[str]]) -> api_pb2.ContainerResources:
    return api_pb2.ContainerResources(
        name=name, devices=[api_pb2.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in groups]
    )


async def test_the_pods_are_parsed_with_our_resources_devices_only(
    lister: Lister, client: PodResourcesClient
) -> None:
    lister.answer = api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                namespace="ns",
                name="a",
                containers=[
                    # The kubelet may list one resource in several groups (one per NUMA node).
                    container("main", (GPU, ["g0-1", "g1-3"]), ("example.com/fpga", ["f0"]), (GPU, ["g2-0"])),
                    container("sidecar"),
                ],
            ),
            api_pb2.PodResources(
                namespace="ns", name="b", containers=[container("main", ("example.com/fpga", ["f1"]))]
            ),
            api_pb2.PodResources(namespace="other", name="a", containers=[container("app", (GPU, ["g3-0"]))]),
            api_pb2.PodResources(namespace="ns", name="empty"),
        ]
    )
    pods = await client.pods()
    assert dict(pods) == {
        ("ns", "a"): KubeletPod(
            "ns", "a", {"main": frozenset({"g0-1", "g1-3", "g2-0"}), "sidecar": frozenset()}
        ),
        ("ns", "b"): KubeletPod("ns", "b", {"main": frozenset()}),
        ("other", "a"): KubeletPod("other", "a", {"app": frozenset({"g3-0"})}),
        ("ns", "empty"): KubeletPod("ns", "empty", {}),
    }
    lister.answer = api_pb2.ListPodResourcesResponse()
    assert dict(await client.pods()) == {}, "each call asks anew"


async def test_the_kubelets_rate_limit_is_waited_out(lister: Lister, client: PodResourcesClient) -> None:
    lister.answer = api_pb2.ListPodResourcesResponse(
        pod_resources=[api_pb2.PodResources(namespace="ns", name="a")]
    )
    lister.errors = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    assert list(await client.pods()) == [("ns", "a")]
    assert lister.calls == 4


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL])
async def test_a_refusal_is_unreachable_naming_the_socket_not_retried(
    lister: Lister, client: PodResourcesClient, code: grpc.StatusCode
) -> None:
    lister.errors = [code]
    with pytest.raises(KubeletUnreachable) as caught:
        await client.pods()
    assert str(client.socket) in str(caught.value)
    assert f"{code.name}: the fake kubelet says {code.name}" in str(caught.value)
    assert lister.calls == 1


async def test_no_kubelet_socket_is_unreachable_naming_it(socket_dir: Path) -> None:
    async with connected(socket_dir / "absent.sock", timeout_s=0.5) as client:
        with pytest.raises(KubeletUnreachable, match=f"PodResources API at {socket_dir}/absent.sock did not"):
            await asyncio.wait_for(client.pods(), timeout=10)


async def test_a_kubelet_that_does_not_answer_is_given_up_at_the_timeout(
    lister: Lister, socket_dir: Path
) -> None:
    lister.stalled = True
    async with connected(socket_dir / "kubelet.sock", timeout_s=0.2) as client:
        # The client's own timeout ends the call, well before this test's.
        with pytest.raises(KubeletUnreachable, match="DEADLINE_EXCEEDED"):
            await asyncio.wait_for(client.pods(), timeout=10)


async def test_a_rate_limit_that_lasts_is_given_up_at_the_timeout(lister: Lister, socket_dir: Path) -> None:
    lister.refuse_all = grpc.StatusCode.RESOURCE_EXHAUSTED
    async with connected(socket_dir / "kubelet.sock", timeout_s=2.0) as client:
        with pytest.raises(KubeletUnreachable, match="RESOURCE_EXHAUSTED"):
            await asyncio.wait_for(client.pods(), timeout=10)
    assert lister.calls > 1, "retried within the timeout"


async def test_a_restarted_kubelet_is_reached_as_soon_as_it_listens_again(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    server = await serve(Lister(), sock)
    try:
        async with connected(sock, timeout_s=1.0) as client:
            assert dict(await client.pods()) == {}
            await server.stop(None)
            sock.unlink(missing_ok=True)
            with pytest.raises(KubeletUnreachable):  # an Allocate while the kubelet restarts
                await client.pods()
            server = await serve(Lister(), sock)
            assert dict(await asyncio.wait_for(client.pods(), timeout=10)) == {}
    finally:
        await server.stop(None)
