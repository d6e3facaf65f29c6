"""HTTP/2 on a bounded server (``hamipy.serving.http2``), against a real server on 127.0.0.1 over
mutual TLS and a raw ``h2`` client: requests multiplex on one connection, HTTP/1.1 clients are still
served, and the limits hold for a client that misbehaves (slow bodies, answers it does not take,
streams reset to open more, garbage, idling)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable

import aiohttp
import h2.errors
import h2.settings
import pytest
from aiohttp import web
from extender_processes import LoopbackPki
from http2_client import H2Client

from hamipy.devcluster import wait_for
from hamipy.serving.http2 import MAX_STREAMS, Http2Answer, Http2App, Http2Request
from hamipy.serving.http_limits import BoundedServer, HttpLimits, start_bounded_site
from hamipy.serving.tls import serving_context

SHORT = HttpLimits(header_timeout_s=5, body_timeout_s=0.5, keepalive_timeout_s=0.5, max_connections=8)
MAX_BODY = 1000


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> LoopbackPki:
    return LoopbackPki.create(tmp_path_factory.mktemp("pki"))


def client_tls(pki: LoopbackPki) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(pki.client_cert, pki.client_key)
    return context


class Ticker:
    """Counts the event loop's turns while it runs (a callback that puts itself back each turn)."""

    turn = 0

    def __init__(self) -> None:
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        Ticker.turn += 1
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._handle.cancel()


class App:
    """Answers ``POST /echo`` with what it got, ``/big`` with ``size`` bytes, ``/hold`` once
    ``gate`` opens, ``/fail`` by raising; records every request."""

    def __init__(self, size: int = 10) -> None:
        self.size = size
        self.gate = asyncio.Event()
        self.seen: list[Http2Request] = []
        self.turns: list[int] = []
        """``Ticker.turn`` when each request reached the app."""
        self.finished = 0

    async def respond(self, request: Http2Request) -> Http2Answer:
        self.seen.append(request)
        self.turns.append(Ticker.turn)
        if request.path == "/hold":
            await self.gate.wait()
            self.finished += 1
            return Http2Answer(200, b"released")
        if request.path == "/big":
            return Http2Answer(200, b"x" * self.size)
        if request.path == "/fail":
            raise RuntimeError("handler bug")
        return Http2Answer(200, request.body, headers={"X-Query": request.query})


def http1_app() -> web.Application:
    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="http/1.1")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    return app


@contextlib.asynccontextmanager
async def serving(
    pki: LoopbackPki, app: App, limits: HttpLimits = SHORT, *, shutdown_timeout_s: float = 1
) -> AsyncIterator[BoundedServer]:
    server = await start_bounded_site(
        http1_app(),
        host="127.0.0.1",
        port=0,
        limits=limits,
        ssl_context=serving_context(pki.server_cert, pki.server_key, client_ca=pki.ca),
        shutdown_timeout_s=shutdown_timeout_s,
        http2=Http2App(app.respond, max_body_bytes=MAX_BODY),
    )
    try:
        yield server
    finally:
        app.gate.set()
        await server.close()


@contextlib.asynccontextmanager
async def client(
    server: BoundedServer, pki: LoopbackPki, *, window: int | None = None
) -> AsyncIterator[H2Client]:
    h2c = await H2Client.connect(server.port, client_tls(pki), window=window)
    try:
        yield h2c
    finally:
        await h2c.close()


async def until(predicate: Callable[[], bool], what: str) -> None:
    await wait_for(predicate, timeout=5, interval=0.01, what=what)


async def test_requests_multiplex_on_one_connection(pki: LoopbackPki) -> None:
    app = App()
    async with serving(pki, app) as server, client(server, pki) as h2c:
        held = [h2c.open("GET", "/hold") for _ in range(20)]
        echoes = [h2c.open("POST", f"/echo?n={i}", f"body {i}".encode()) for i in range(20)]
        for i, sid in enumerate(echoes):  # answered while the held ones wait
            response = await h2c.response(sid)
            assert (response.status, response.body) == (200, f"body {i}".encode())
            assert response.headers["x-query"] == f"n={i}"
            assert response.headers["content-type"] == "application/json"
        app.gate.set()
        for sid in held:
            assert (await h2c.response(sid)).body == b"released"
        assert (server.stats.accepted, server.stats.http2) == (1, 1)
        assert [r.method for r in app.seen].count("POST") == 20
        assert app.seen[-1].remote == "127.0.0.1"


async def test_http1_clients_are_served_by_the_aiohttp_app(pki: LoopbackPki) -> None:
    app = App()
    async with serving(pki, app) as server:
        connector = aiohttp.TCPConnector(ssl=client_tls(pki))  # offers no ALPN: HTTP/1.1
        async with (
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"https://127.0.0.1:{server.port}/healthz") as response,
        ):
            assert (response.status, await response.text()) == (200, "http/1.1")
        assert (server.stats.accepted, server.stats.http2) == (1, 0)
        assert app.seen == []


async def test_a_body_over_the_limit_reaches_the_app_as_too_large(pki: LoopbackPki) -> None:
    app = App()
    async with serving(pki, app) as server, client(server, pki) as h2c:
        response = await h2c.request("POST", "/echo", b"y" * (MAX_BODY + 1))
        assert response.status == 200
        assert response.body == b""
        assert app.seen[-1].too_large
        # The connection still serves.
        assert (await h2c.request("POST", "/echo", b"y" * MAX_BODY)).body == b"y" * MAX_BODY
        assert not app.seen[-1].too_large


async def test_an_answer_larger_than_the_clients_window_arrives_whole(pki: LoopbackPki) -> None:
    app = App(size=200_000)
    async with serving(pki, app) as server, client(server, pki, window=1000) as h2c:
        response = await h2c.request("GET", "/big")
        assert (response.status, len(response.body)) == (200, 200_000)


async def test_a_head_request_gets_the_headers_of_a_get_and_no_body(pki: LoopbackPki) -> None:
    app = App(size=3000)
    async with serving(pki, app) as server, client(server, pki) as h2c:
        response = await h2c.request("HEAD", "/big")
        assert (response.status, response.headers["content-length"], response.body) == (200, "3000", b"")
        assert response.reset is None
        # The connection still serves, and a GET gets the body the HEAD did not.
        assert len((await h2c.request("GET", "/big")).body) == 3000


async def test_a_handler_that_raises_is_answered_500(pki: LoopbackPki) -> None:
    async with serving(pki, App()) as server, client(server, pki) as h2c:
        response = await h2c.request("GET", "/fail")
        assert response.status == 500
        assert b"internal error" in response.body
        assert (await h2c.request("POST", "/echo", b"ok")).body == b"ok"


async def test_the_stream_limit_counts_reset_streams_whose_handler_still_runs(pki: LoopbackPki) -> None:
    """A client that resets each stream to open another (HTTP/2 "rapid reset") gets at most
    MAX_STREAMS handlers at once; the next stream is refused, and a reset handler is not cancelled."""
    app = App()
    async with serving(pki, app) as server, client(server, pki) as h2c:
        await asyncio.wait_for(h2c.settings.wait(), 5)
        assert h2c.conn.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == MAX_STREAMS
        for _ in range(MAX_STREAMS):
            h2c.reset(h2c.open("GET", "/hold"))
        await until(lambda: len(app.seen) == MAX_STREAMS, "every held stream to reach the app")
        refused = await h2c.response(h2c.open("POST", "/echo", b"one more"))
        assert refused.reset == h2.errors.ErrorCodes.REFUSED_STREAM
        app.gate.set()
        await until(lambda: app.finished == MAX_STREAMS, "the reset streams' handlers to finish")
        # Their answers were dropped, and the slots are free again.
        assert (await h2c.request("POST", "/echo", b"again")).body == b"again"


async def test_a_body_that_never_ends_cuts_the_connection_after_the_body_timeout(pki: LoopbackPki) -> None:
    app = App()
    async with serving(pki, app) as server, client(server, pki) as h2c:
        h2c.open("POST", "/echo", b"half", end=False)
        await asyncio.wait_for(h2c.closed.wait(), 5)
        assert server.stats.body_timeouts == 1
        assert app.seen == []


async def test_an_answer_the_client_never_takes_cuts_the_connection(pki: LoopbackPki) -> None:
    app = App(size=100_000)
    async with serving(pki, app) as server, client(server, pki, window=10) as h2c:
        h2c.conn.acknowledge_received_data = lambda *args: None  # type: ignore[method-assign]
        h2c.open("GET", "/big")
        await asyncio.wait_for(h2c.closed.wait(), 5)
        assert server.stats.body_timeouts == 1


async def test_an_idle_connection_gets_goaway_after_the_keepalive_timeout(pki: LoopbackPki) -> None:
    async with serving(pki, App()) as server, client(server, pki) as h2c:
        assert (await h2c.request("POST", "/echo", b"x")).status == 200
        await asyncio.wait_for(h2c.closed.wait(), 5)
        assert h2c.goaway == h2.errors.ErrorCodes.NO_ERROR
        assert server.stats.idle_timeouts == 1
        await until(lambda: server.stats.held == 0, "the slot to be freed")


async def test_a_request_in_flight_keeps_the_connection_past_the_keepalive_timeout(pki: LoopbackPki) -> None:
    app = App()
    async with serving(pki, app) as server, client(server, pki) as h2c:
        held = h2c.open("GET", "/hold")
        await until(lambda: len(app.seen) == 1, "the request to reach the app")
        await asyncio.sleep(SHORT.keepalive_timeout_s * 2)  # longer than the idle limit, on purpose
        assert not h2c.closed.is_set()
        app.gate.set()
        assert (await h2c.response(held)).body == b"released"


async def test_garbage_gets_goaway_and_the_connection_closed(pki: LoopbackPki) -> None:
    async with serving(pki, App()) as server, client(server, pki) as h2c:
        await asyncio.wait_for(h2c.settings.wait(), 5)
        h2c.send_raw(b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00")  # WINDOW_UPDATE of 0
        await asyncio.wait_for(h2c.closed.wait(), 5)
        assert h2c.goaway == h2.errors.ErrorCodes.PROTOCOL_ERROR
        await until(lambda: server.stats.held == 0, "the slot to be freed")


async def test_shutdown_answers_requests_in_flight_and_refuses_new_ones(pki: LoopbackPki) -> None:
    app = App()
    async with serving(pki, app, shutdown_timeout_s=5) as server, client(server, pki) as h2c:
        held = h2c.open("GET", "/hold")
        await until(lambda: len(app.seen) == 1, "the request to reach the app")
        closing = asyncio.create_task(server.close())
        for _ in range(500):  # answered until the drain begins, refused from then on
            late = await h2c.response(h2c.open("POST", "/echo", b"late"))
            if late.reset is not None:
                break
            await asyncio.sleep(0.01)
        assert late.reset == h2.errors.ErrorCodes.REFUSED_STREAM
        assert not closing.done()  # the held request is still in flight
        app.gate.set()
        assert (await h2c.response(held)).body == b"released"
        await asyncio.wait_for(closing, 5)
        await asyncio.wait_for(h2c.closed.wait(), 5)
        assert h2c.goaway == h2.errors.ErrorCodes.NO_ERROR


async def test_requests_that_arrive_together_are_started_a_loop_turn_apart(pki: LoopbackPki) -> None:
    """kube-scheduler sends its requests back to back on one connection; framing them all in one
    step would make a filter on another connection wait for all of them."""
    app = App()
    async with serving(pki, app) as server, client(server, pki) as h2c:
        ticker = Ticker()
        # About a 1,000-node filter each (the node names), all three in one write.
        sids = [h2c.open("POST", "/echo", b"n" * 15_000, flush=False) for _ in range(3)]
        h2c.flush()
        try:
            await until(lambda: len(app.seen) == 3, "the three requests to reach the app")
        finally:
            ticker.stop()
        assert len(set(app.turns)) == 3, app.turns  # each in a loop turn of its own
        for sid in sids:
            assert (await h2c.response(sid)).status == 200


async def test_http2_needs_tls(pki: LoopbackPki) -> None:
    with pytest.raises(ValueError, match="over TLS only"):
        await start_bounded_site(
            http1_app(),
            host="127.0.0.1",
            port=0,
            limits=SHORT,
            http2=Http2App(App().respond, max_body_bytes=1),
        )
