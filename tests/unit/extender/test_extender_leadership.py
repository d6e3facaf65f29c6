"""A replica that does not lead never decides (docs/extender.md#replicas): it forwards to the leader,
answers 503 with the reason while no leader is known, never forwards a forwarded request again (a
stale view of who leads cannot loop), and its binds never decide from its model."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from builders import allocation, gpu, gpu_node, gpu_pod
from extender_fakes import bind_args, elected
from fake_kube import FakeKube

from hamipy.devcluster import wait_for
from hamipy.extender.leadership import FORWARDED_HEADER, REDIRECTED_QUERY, Leadership
from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.routes import Routes, make_app
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import NullKube
from hamipy.kube.resources import node_path
from hamipy.protocol.config import Config
from hamipy.protocol.devices import ContainerDevice
from hamipy.serving.http2 import Http2Request


def server(api: FakeKube | NullKube, **settings: Any) -> ExtenderServer:
    """A replica (not started) with these ``ExtenderSettings``."""
    return ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(**settings),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=api,
    )


def routes(**leadership: Any) -> Routes:
    """The routes of a replica with leader election on, its ``Leadership`` made with ``leadership``."""
    srv = server(NullKube())
    role = Leadership(election=True, api=NullKube(), model=srv.model, telemetry=srv.telemetry, **leadership)
    return Routes(srv.scheduler, max_body_bytes=1 << 20, health=srv.health, leadership=role)


@contextlib.asynccontextmanager
async def serving(**leadership: Any) -> AsyncIterator[str]:
    """The routes of a replica with leader election on, its ``Leadership`` made with
    ``leadership``; its URL."""
    app = make_app(routes(**leadership))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def follower() -> AsyncIterator[str]:
    """A replica that leads nothing and knows no leader (its elector not joined yet)."""
    async with serving(leader_wait_s=0.1) as url:
        yield url


async def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.post(url + path, json=body, headers=headers or {}) as resp,
    ):
        return resp.status, await resp.json()


@pytest.mark.parametrize("path", ["/filter", "/prioritize", "/bind"])
async def test_a_replica_that_does_not_lead_answers_503_with_why(follower: str, path: str) -> None:
    body = (
        msgspec.to_builtins(bind_args(gpu_pod("p")))
        if path == "/bind"
        else {"Pod": gpu_pod("p"), "NodeNames": ["n"]}
    )
    status, answer = await post(follower, path, body)
    assert status == 503
    assert answer["Error"] == "this extender has not joined the leader election yet"
    status, answer = await post(follower, path, body, {FORWARDED_HEADER: "replica-0"})
    assert status == 503
    assert answer["Error"].endswith("is not the leader")


def test_without_election_a_replica_decides_and_binds_from_its_model() -> None:
    srv = server(FakeKube())
    assert srv.leadership.deciding()
    assert srv.leadership.exclusive()


def test_with_election_binds_never_decide_from_the_model_before_leading() -> None:
    srv = server(FakeKube(), leader_election=True)
    assert not srv.leadership.deciding()
    assert not srv.leadership.exclusive()


async def test_a_new_leader_takes_every_bound_pod_into_its_model_before_binds_decide_from_it() -> None:
    """The watch has not delivered what the previous leader bound: until the catch-up read, binds
    may not decide from the model; after it, the model holds that pod's allocation."""
    kube = FakeKube()
    kube.add(gpu_node("n", [gpu("A", 0, count=2)], ours=True))
    kube.add(
        gpu_pod("earlier", node_name="n", annotations=allocation(allocated="A,NVIDIA,1000,0:;", node="n"))
    )
    kube.add(gpu_pod("pending"))
    model = ClusterModel()
    model.replace_nodes(kube.items(node_path()))
    model.replace_pods([])
    leadership = Leadership(
        election=True,
        elector=elected(transitions=4),
        api=kube,
        model=model,
        telemetry=Telemetry.create(stream=io.StringIO()),
    )
    assert leadership.deciding()
    assert not leadership.exclusive()
    following = asyncio.create_task(leadership.run())
    try:
        await wait_for(leadership.exclusive, timeout=5, what="the catch-up")
    finally:
        following.cancel()
    assert set(model.contributions) == {PodUid("uid-ns-earlier")}
    assert ("GET", "/api/v1/pods") in kube.calls


async def test_a_replica_another_leads_drops_its_reservations_and_keeps_allocations() -> None:
    """What it reserved while it led (a filter's choice, a Binding whose answer was lost) would hold
    GPUs in its model for no one: a follower never filters or binds."""
    kube = FakeKube()
    kube.add(gpu_node("n", [gpu("A", 0, count=2)], ours=True))
    model = ClusterModel()
    model.replace_nodes(kube.items(node_path()))
    model.replace_pods(
        [gpu_pod("earlier", node_name="n", annotations=allocation(allocated="A,NVIDIA,1000,0:;", node="n"))]
    )
    model.reserve(
        uid=PodUid("uid-ns-p"),
        namespace="ns",
        name="p",
        node=NodeName("n"),
        devices=[[ContainerDevice("A", "NVIDIA", 1000, 0)]],
        n_init=0,
        expires_at=float("inf"),
    )
    leadership = Leadership(
        election=True,
        elector=elected(leader_url="http://leader.test:8888"),
        api=kube,
        model=model,
        telemetry=Telemetry.create(stream=io.StringIO()),
    )
    following = asyncio.create_task(leadership.run())
    try:
        await wait_for(lambda: model.held["reserved"] == 0, timeout=5, what="reservations dropped")
    finally:
        following.cancel()
    assert set(model.contributions) == {PodUid("uid-ns-earlier")}


@pytest.fixture
async def redirecting() -> AsyncIterator[str]:
    """A follower with ``--follower-redirect`` whose leader serves at ``http://leader.test:8888``."""
    async with serving(elector=elected(leader_url="http://leader.test:8888/"), redirects=True) as url:
        yield url


@pytest.mark.parametrize("path", ["/filter", "/prioritize", "/bind", "/preempt"])
async def test_a_redirecting_follower_sends_the_caller_to_the_leader_and_reads_nothing(
    redirecting: str, path: str
) -> None:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.post(redirecting + path, data=b"not even JSON", allow_redirects=False) as resp,
    ):
        assert resp.status == 307
        assert resp.headers["Location"] == f"http://leader.test:8888{path}?{REDIRECTED_QUERY}=me_1"


async def test_a_redirected_request_that_reaches_a_follower_is_refused_not_redirected_again(
    redirecting: str,
) -> None:
    status, answer = await post(redirecting, f"/filter?{REDIRECTED_QUERY}=other", {"Pod": gpu_pod("p")})
    assert status == 503
    assert answer["Error"].endswith("is not the leader")


def http2_post(
    path: str, body: bytes, *, query: str = "", headers: dict[str, str] | None = None
) -> Http2Request:
    return Http2Request("POST", path, query, headers or {}, body, too_large=False, remote="127.0.0.1")


async def test_over_http2_a_follower_redirects_and_never_passes_a_request_on_twice() -> None:
    """The same rules as over HTTP/1.1: kube-scheduler speaks HTTP/2 to a TLS extender."""
    redirecting = routes(elector=elected(leader_url="http://leader.test:8888/"), redirects=True)
    answer = await redirecting.respond_http2(http2_post("/bind", b"not even JSON"))
    assert answer.status == 307
    assert answer.headers["location"] == f"http://leader.test:8888/bind?{REDIRECTED_QUERY}=me_1"
    body = json.dumps({"Pod": gpu_pod("p"), "NodeNames": ["n"]}).encode()
    for request in (
        http2_post("/filter", body, query=f"{REDIRECTED_QUERY}=other"),
        http2_post("/filter", body, headers={FORWARDED_HEADER.lower(): "replica-0"}),
    ):
        answer = await redirecting.respond_http2(request)
        assert answer.status == 503
        assert isinstance(answer.body, bytes)
        assert json.loads(answer.body)["Error"].endswith("is not the leader")


@pytest.mark.parametrize(
    ("query", "status"),
    [
        (f"a=1&{REDIRECTED_QUERY}", 503),  # named without a value: redirected already
        (f"a={REDIRECTED_QUERY}=x", 307),  # only inside another key's value: not redirected yet
    ],
)
async def test_redirected_is_read_from_the_parsed_query_over_both_protocols(
    redirecting: str, query: str, status: int
) -> None:
    body = {"Pod": gpu_pod("p"), "NodeNames": ["n"]}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.post(f"{redirecting}/filter?{query}", json=body, allow_redirects=False) as resp,
    ):
        assert resp.status == status
    follower = routes(elector=elected(leader_url="http://leader.test:8888/"), redirects=True)
    answer = await follower.respond_http2(http2_post("/filter", json.dumps(body).encode(), query=query))
    assert answer.status == status


# -- cold standby (--cold-standby) ----------------------------------------------------------------


def cold_server(kube: FakeKube) -> ExtenderServer:
    return server(kube, leader_election=True, cold_standby=True)


def test_a_cold_standby_is_ready_to_pass_requests_on_before_it_watches_anything() -> None:
    srv = cold_server(FakeKube())
    assert not srv.health.watching
    assert srv.health.not_ready() is None
    assert not srv.health.synced()


def test_a_hot_standby_is_not_ready_until_its_watches_have_listed() -> None:
    srv = server(FakeKube(), leader_election=True)
    assert srv.health.watching
    not_ready = srv.health.not_ready()
    assert not_ready is not None
    assert not_ready.startswith("model not synced yet (listing nodes and pods")


def test_a_leader_whose_model_is_not_listed_yet_decides_nothing() -> None:
    """Holding the Lease is not enough: with an empty model every pod would be refused."""
    listed = False
    role = Leadership(
        election=True,
        elector=elected(),
        api=NullKube(),
        model=ClusterModel(),
        telemetry=Telemetry.create(stream=io.StringIO()),
        ready=lambda: listed,
    )
    assert not role.deciding()
    listed = True
    assert role.deciding()


async def test_a_leader_still_listing_answers_503_with_why() -> None:
    async with serving(elector=elected(), leader_wait_s=0.1, ready=lambda: False) as url:
        status, answer = await post(url, "/filter", {"Pod": gpu_pod("p"), "NodeNames": ["n"]})
    assert status == 503
    assert answer["Error"] == (
        "this extender (me_1) holds the Lease but cannot decide yet "
        "(listing the cluster, or renewing the Lease)"
    )


async def test_a_cold_standby_taking_the_lease_lists_the_cluster_then_catches_up_then_decides() -> None:
    kube = FakeKube()
    kube.add(gpu_node("n", [gpu("A", 0, count=2)], ours=True))
    kube.add(
        gpu_pod("earlier", node_name="n", annotations=allocation(allocated="A,NVIDIA,1000,0:;", node="n"))
    )
    srv = cold_server(kube)
    srv.leadership.elector = elected(transitions=2)
    assert not srv.leadership.deciding()  # leads, but has not listed
    following = asyncio.create_task(srv.leadership.run())
    try:
        # The server's supervisor runs the watches it starts; the fake API lists, then holds each
        # watch open.
        await wait_for(srv.leadership.exclusive, timeout=5, what="the cold leader to list and catch up")
        assert srv.health.watching
        assert srv.leadership.deciding()
        assert srv.health.not_ready() is None
        assert "n" in srv.model.nodes
        assert set(srv.model.contributions) == {PodUid("uid-ns-earlier")}
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await srv.supervisor.stop()
