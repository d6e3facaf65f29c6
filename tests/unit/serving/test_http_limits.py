"""The limits of our HTTP servers, against a real server on 127.0.0.1 and raw sockets: slow headers,
slow bodies, idle connections and TLS handshakes that never start are cut in time; the connection
cap holds, evicting an idle connection or the longest sender so that a prompt request still gets
in; a client that leaves mid-request is one log line."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import gc
import io
import json
import logging
import socket
import ssl
import struct
import time
from asyncio.sslproto import SSLProtocol
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from hamipy.kube.certs import KeyPair, issue_cert, make_ca
from hamipy.serving.http_limits import BoundedServer, HttpLimits, start_bounded_site
from hamipy.telemetry import make_logger

SHORT = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=0.5, max_connections=8)
TRICKLE_S = 0.2
HEAD = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"


def make_app(gate: asyncio.Event | None = None, steps: list[str] | None = None) -> web.Application:
    """``steps`` records where ``/echo`` and ``/read-then-hold`` are: ``reading``, then ``read``."""

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def read(request: web.Request) -> bytes:
        if steps is not None:
            steps.append("reading")
        body = await request.read()
        if steps is not None:
            steps.append("read")
        return body

    async def echo(request: web.Request) -> web.Response:
        return web.Response(text=str(len(await read(request))))

    async def hold(request: web.Request) -> web.Response:
        assert gate is not None
        await gate.wait()
        return web.Response(text="released")

    async def read_then_hold(request: web.Request) -> web.Response:
        await read(request)
        return await hold(request)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/echo", echo)
    app.router.add_get("/hold", hold)
    app.router.add_post("/read-then-hold", read_then_hold)
    return app


@contextlib.asynccontextmanager
async def serving(
    limits: HttpLimits = SHORT,
    *,
    tls: ssl.SSLContext | None = None,
    gate: asyncio.Event | None = None,
    steps: list[str] | None = None,
    log: io.StringIO | None = None,
) -> AsyncIterator[BoundedServer]:
    server = await start_bounded_site(
        make_app(gate, steps),
        host="127.0.0.1",
        port=0,
        limits=limits,
        ssl_context=tls,
        shutdown_timeout_s=1,
        logger=None if log is None else make_logger("test", log),
    )
    try:
        yield server
    finally:
        await server.close()


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` (the server's counters) every 10 ms for up to 5 s."""
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


async def closed_by_server(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """What the server sent before closing (waits for the close, at most ``timeout_s``)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    except ConnectionResetError:
        return b""


async def trickle(writer: asyncio.StreamWriter, data: bytes, sent: list[int]) -> None:
    """Send ``data`` a byte at a time, ``TRICKLE_S`` apart, until done or the server hangs up."""
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            sent.append(byte)
            await asyncio.sleep(TRICKLE_S)


async def get(url: str, *, tls: ssl.SSLContext | None = None) -> tuple[int, str]:
    connector = aiohttp.TCPConnector(ssl=tls if tls is not None else False, force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(url) as response,
    ):
        return response.status, await response.text()


async def open_raw(server: BoundedServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server.port), 5)


async def close_raw(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await asyncio.wait_for(writer.wait_closed(), 5)


async def hold_every_slot(
    server: BoundedServer, n: int, *, tls: ssl.SSLContext | None = None
) -> list[asyncio.Task[tuple[int, str]]]:
    """``n`` (the cap) ``GET /hold`` requests, returned once all are in flight (until the gate opens)."""
    scheme = "https" if tls is not None else "http"
    url = f"{scheme}://127.0.0.1:{server.port}/hold"
    busy = [asyncio.create_task(get(url, tls=tls)) for _ in range(n)]
    await until(lambda: server.stats.held == n and server.stats.waiting == 0, f"{n} requests in flight")
    return busy


# -- plain HTTP -------------------------------------------------------------------------------------------


async def test_a_prompt_client_is_served_twice_on_one_connection() -> None:
    async with serving() as server:
        reader, writer = await open_raw(server)
        for _ in range(2):
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(reader.readexactly(1), 5) == b"3"
        await close_raw(writer)
        assert server.stats.header_timeouts == server.stats.body_timeouts == 0


async def test_trickled_headers_are_cut_after_the_header_timeout() -> None:
    async with serving() as server:
        reader, writer = await open_raw(server)
        started = time.monotonic()
        sent: list[int] = []
        sender = asyncio.create_task(trickle(writer, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", sent))
        answer = await closed_by_server(reader)
        elapsed = time.monotonic() - started
        sender.cancel()
        await close_raw(writer)
        assert answer == b""
        assert 0.4 <= elapsed < 3, elapsed
        assert 0 < len(sent) < 10  # still sending its request line when cut
        assert server.stats.header_timeouts == 1
        await until(lambda: server.stats.held == 0, "the slot to be free")


async def test_trickled_body_is_cut_after_the_body_timeout(caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as server:
        reader, writer = await open_raw(server)
        writer.write(HEAD)
        started = time.monotonic()
        sent: list[int] = []
        sender = asyncio.create_task(trickle(writer, b"x" * 1000, sent))
        answer = await closed_by_server(reader)
        elapsed = time.monotonic() - started
        sender.cancel()
        await close_raw(writer)
        assert answer == b""
        # The handler's read was cut under it: no "Error handling request" (a 500) from aiohttp.
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert 0.4 <= elapsed < 3, elapsed
        assert 0 < len(sent) < 20
        assert server.stats.body_timeouts == 1
        assert server.stats.header_timeouts == 0
        assert (await get(f"http://127.0.0.1:{server.port}/healthz")) == (200, "ok")


async def test_an_idle_connection_is_closed_after_the_keepalive_timeout() -> None:
    limits = HttpLimits(header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=0.5)
    async with serving(limits) as server:
        reader, writer = await open_raw(server)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        assert await closed_by_server(reader) == b"ok"  # the body, then the close
        elapsed = time.monotonic() - answered
        await close_raw(writer)
        assert 0.4 <= elapsed < 3, elapsed
        assert server.stats.idle_timeouts == 1


async def test_a_second_request_is_timed_from_its_first_byte() -> None:
    limits = HttpLimits(header_timeout_s=0.5, body_timeout_s=5, keepalive_timeout_s=30)
    async with serving(limits) as server:
        reader, writer = await open_raw(server)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 5)
        sent: list[int] = []
        started = time.monotonic()
        sender = asyncio.create_task(trickle(writer, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", sent))
        assert await closed_by_server(reader) == b""
        elapsed = time.monotonic() - started
        sender.cancel()
        await close_raw(writer)
        assert 0.4 <= elapsed < 3, elapsed  # the header timeout, not the 30 s keep-alive
        assert server.stats.header_timeouts == 1


# -- the connection cap -----------------------------------------------------------------------------------


async def test_the_cap_holds_and_healthz_gets_in_by_evicting_the_longest_waiter() -> None:
    cap, extra = 4, 3
    limits = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, keepalive_timeout_s=30, max_connections=cap)
    async with serving(limits) as server:
        idle = [await open_raw(server) for _ in range(cap + extra)]
        await until(lambda: server.stats.accepted == cap + extra, "every connection to be accepted")
        assert server.stats.held == cap
        assert server.stats.evicted == extra
        # The first ones were evicted (closed without a byte), the newest still held.
        for reader, _ in idle[:extra]:
            assert await closed_by_server(reader) == b""
        assert all(not reader.at_eof() for reader, _ in idle[extra:])
        # A prompt request gets in at once, evicting the longest waiter.
        assert (await get(f"http://127.0.0.1:{server.port}/healthz")) == (200, "ok")
        assert server.stats.held <= cap
        # The slow ones are all cut after the header timeout, and the server still answers.
        for reader, _ in idle:
            assert await closed_by_server(reader) == b""
        await until(lambda: server.stats.held == 0, "every slot to be free")
        assert server.stats.header_timeouts == cap - 1
        assert (await get(f"http://127.0.0.1:{server.port}/healthz")) == (200, "ok")
        for _, writer in idle:
            await close_raw(writer)


LONG = HttpLimits(header_timeout_s=30, body_timeout_s=30, keepalive_timeout_s=30, max_connections=3)
"""Timeouts far past any test's wait: what happens at the cap is the cap's doing."""


async def stall_body(
    server: BoundedServer, steps: list[str]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sent its head and part of its body, and is then silent (a byte a second is
    no different to the server), returned once the handler waits for the rest."""
    reader, writer = await open_raw(server)
    readers = steps.count("reading")
    writer.write(HEAD + b"x")
    await until(lambda: steps.count("reading") == readers + 1, "the handler to wait for the body")
    return reader, writer


async def test_at_the_cap_the_longest_stalled_body_is_evicted_so_a_prompt_request_gets_in() -> None:
    steps: list[str] = []
    async with serving(LONG, steps=steps) as server:
        stalled = [await stall_body(server, steps) for _ in range(3)]
        assert server.stats.held == 3
        assert (await get(f"http://127.0.0.1:{server.port}/healthz")) == (200, "ok")
        assert server.stats.evicted == 1
        assert server.stats.queued_total == 0
        assert await closed_by_server(stalled[0][0]) == b""  # the longest sender, cut unanswered
        assert all(not reader.at_eof() for reader, _ in stalled[1:])
        assert server.stats.body_timeouts == server.stats.client_gone == 0
        for _, writer in stalled:
            await close_raw(writer)


async def test_at_the_cap_a_stalled_body_goes_before_an_idle_kept_alive_connection() -> None:
    # An idle connection may carry the client's next request as it is cut (a POST then fails: Go
    # does not retry it); a stalled body that the cap's worth of connections came after has had
    # longer than anyone.
    steps: list[str] = []
    limits = dataclasses.replace(LONG, max_connections=3)
    async with serving(limits, steps=steps) as server:
        url = f"http://127.0.0.1:{server.port}/healthz"
        kept_reader, kept_writer = await open_raw(server)
        kept_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(kept_reader.readuntil(b"\r\n\r\nok"), 5)
        stalled_reader, stalled_writer = await stall_body(server, steps)
        for _ in range(2):  # answered and gone, below the cap
            assert (await get(url)) == (200, "ok")
            await until(lambda: server.stats.held == 2, "the answered connection to go")
        _, silent_writer = await open_raw(server)
        await until(lambda: server.stats.held == 3, "the cap's worth of connections after the body")
        assert (await get(url)) == (200, "ok")
        assert await closed_by_server(stalled_reader) == b""
        kept_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(kept_reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert server.stats.evicted == 1
        for writer in (kept_writer, stalled_writer, silent_writer):
            await close_raw(writer)


async def test_at_the_cap_idle_connections_go_before_a_newcomer_still_sending() -> None:
    # A client holding all but one slot idle must not make a prompt newcomer (a probe, the API
    # server's new connection) the only one the next connection can evict.
    async with serving(dataclasses.replace(LONG, max_connections=4)) as server:
        idle = []
        for _ in range(3):
            reader, writer = await open_raw(server)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 5)
            idle.append((reader, writer))
        prompt_reader, prompt_writer = await open_raw(server)
        await until(lambda: server.stats.held == 4, "the newcomer to be held")
        _, late_writer = await open_raw(server)
        await until(lambda: server.stats.evicted == 1, "one eviction")
        prompt_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(prompt_reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await closed_by_server(idle[0][0]) == b""  # the longest idle made room
        assert all(not reader.at_eof() for reader, _ in idle[1:])
        for writer in [w for _, w in idle] + [prompt_writer, late_writer]:
            await close_raw(writer)


async def test_a_connection_whose_body_has_arrived_is_not_evicted_while_its_handler_runs() -> None:
    gate = asyncio.Event()
    steps: list[str] = []
    limits = dataclasses.replace(LONG, max_connections=1)
    async with serving(limits, gate=gate, steps=steps) as server:
        reader, writer = await open_raw(server)
        writer.write(b"POST /read-then-hold HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nx")
        await until(lambda: steps == ["reading"], "the handler to wait for the body")
        writer.write(b"y")
        await until(lambda: steps == ["reading", "read"], "the body to arrive")
        waiting = asyncio.create_task(get(f"http://127.0.0.1:{server.port}/healthz"))
        await until(lambda: server.stats.queued == 1, "the new connection to queue")
        assert server.stats.evicted == 0
        gate.set()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await waiting == (200, "ok")
        await close_raw(writer)


async def test_a_connection_evicted_before_its_handler_starts_leaves_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A newcomer at the cap is accepted in one turn of the event loop and admitted (evicting) in the
    # next; a request head parsed in between has its handler start on a connection already cut.
    steps: list[str] = []
    async with serving(dataclasses.replace(LONG, max_connections=1), steps=steps) as server:
        reader, writer = await open_raw(server)
        await until(lambda: server.stats.held == 1, "the connection to be held")
        newcomer = socket.socket()
        newcomer.setblocking(False)
        newcomer.connect_ex(("127.0.0.1", server.port))  # on loopback, done at once
        await asyncio.sleep(0)  # the server accepts it in this turn, admits it in the next
        writer.write(HEAD + b"x")
        prompt_reader, prompt_writer = await asyncio.open_connection(sock=newcomer)
        prompt_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(prompt_reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await closed_by_server(reader) == b""
        assert server.stats.evicted == 1
        assert steps == []  # no handler ran: it was not already reading the body when cut
        for w in (writer, prompt_writer):
            await close_raw(w)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(
    ("abort", "reason"),
    [
        pytest.param(False, "closed by the client", id="closed"),
        pytest.param(True, "Connection reset by peer", id="reset"),
    ],
)
async def test_a_client_gone_mid_body_is_one_log_line_and_counted(
    caplog: pytest.LogCaptureFixture, abort: bool, reason: str
) -> None:
    steps: list[str] = []
    log = io.StringIO()
    async with serving(LONG, steps=steps, log=log) as server:
        _, writer = await stall_body(server, steps)
        peer = f"127.0.0.1:{writer.get_extra_info('sockname')[1]}"
        if abort:  # a reset, not an orderly close: no lingering on close
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await close_raw(writer)
        await until(lambda: server.stats.client_gone == 1, "the loss to be counted")
        assert (await get(f"http://127.0.0.1:{server.port}/healthz")) == (200, "ok")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert len(lines) == 1, lines
    (line,) = lines
    assert line["event"] == "client left mid-request"
    assert (line["peer"], line["method"], line["path"]) == (peer, "POST", "/echo")
    assert reason in line["reason"]
    assert "exception" not in line
    assert (server.stats.evicted, server.stats.body_timeouts) == (0, 0)


async def test_a_client_gone_while_its_unread_body_is_drained_leaves_no_task_behind() -> None:
    # aiohttp drains a body the handler did not read (for up to the body timeout) so that the
    # client gets its answer; a client that leaves meanwhile must not keep that drain waiting.
    async with serving(LONG) as server:
        before = len(asyncio.all_tasks())
        reader, writer = await open_raw(server)
        writer.write(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nx")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 405")
        writer.transport.abort()
        await until(lambda: len(asyncio.all_tasks()) == before, "the connection's task to end")
        assert server.stats.held == server.stats.client_gone == 0


async def test_at_the_cap_with_every_connection_busy_a_new_one_waits_for_a_slot() -> None:
    gate = asyncio.Event()
    limits = HttpLimits(header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=5, max_connections=2)
    async with serving(limits, gate=gate) as server:
        busy = await hold_every_slot(server, 2)
        reader, writer = await open_raw(server)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: server.stats.queued == 1, "the new connection to queue")
        assert server.stats.held == 2
        assert server.stats.refused == 0
        # A slot frees as the held requests are answered: the queued one is served, and the busy
        # ones were told to close (they handed their slots on rather than idling in them).
        gate.set()
        assert [await task for task in busy] == [(200, "released")] * 2
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert server.stats.queued == 0
        assert server.stats.queued_total == 1
        assert server.stats.accepted == 3
        await close_raw(writer)


async def test_busy_connections_close_once_answered_while_others_queue() -> None:
    gate = asyncio.Event()
    limits = HttpLimits(header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=5, max_connections=1)
    async with serving(limits, gate=gate) as server:
        held_reader, held_writer = await open_raw(server)
        held_writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: server.stats.held == 1 and server.stats.waiting == 0, "the request in flight")
        queued_reader, queued_writer = await open_raw(server)
        queued_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: server.stats.queued == 1, "the second connection to queue")
        gate.set()
        answer = await closed_by_server(held_reader)  # answered, then closed by the server
        assert answer.startswith(b"HTTP/1.1 200")
        assert b"Connection: close" in answer
        head = await asyncio.wait_for(queued_reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert b"Connection: close" not in head  # nobody waits now: kept alive
        for writer in (held_writer, queued_writer):
            await close_raw(writer)


async def test_a_queued_connection_is_cut_after_the_header_timeout() -> None:
    gate = asyncio.Event()
    limits = HttpLimits(header_timeout_s=0.5, body_timeout_s=5, keepalive_timeout_s=5, max_connections=1)
    async with serving(limits, gate=gate) as server:
        (busy,) = await hold_every_slot(server, 1)
        reader, writer = await open_raw(server)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await closed_by_server(reader) == b""
        assert server.stats.queue_timeouts == 1
        assert server.stats.queued == 0
        gate.set()
        assert await busy == (200, "released")
        await close_raw(writer)


async def test_at_the_cap_with_the_queue_full_a_new_one_is_refused() -> None:
    gate = asyncio.Event()
    limits = HttpLimits(
        header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=5, max_connections=2, max_queued=1
    )
    async with serving(limits, gate=gate) as server:
        url = f"http://127.0.0.1:{server.port}"
        busy = await hold_every_slot(server, 2)
        queued = await open_raw(server)
        await until(lambda: server.stats.queued == 1, "one connection to queue")
        reader, writer = await open_raw(server)
        assert await closed_by_server(reader) == b""
        await close_raw(writer)
        assert server.stats.refused == 1
        gate.set()
        assert [await task for task in busy] == [(200, "released")] * 2
        assert (await get(f"{url}/healthz")) == (200, "ok")
        await close_raw(queued[1])


async def test_stopping_cuts_queued_connections() -> None:
    gate = asyncio.Event()
    limits = HttpLimits(header_timeout_s=30, body_timeout_s=30, keepalive_timeout_s=30, max_connections=1)
    async with serving(limits, gate=gate) as server:
        (busy,) = await hold_every_slot(server, 1)
        reader, writer = await open_raw(server)
        await until(lambda: server.stats.queued == 1, "the second connection to queue")
        gate.set()  # the held request ends as the server stops: its slot must not go to the queued one
        stopping = asyncio.create_task(server.close())
        assert await closed_by_server(reader) == b""
        await stopping
        with contextlib.suppress(aiohttp.ClientError):
            await busy
    await close_raw(writer)


# -- TLS --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[KeyPair, Path, Path]:
    ca = make_ca("test-ca", validity=datetime.timedelta(days=1))
    leaf = issue_cert(
        ca,
        common_name="127.0.0.1",
        validity=datetime.timedelta(days=1),
        ip_addresses=["127.0.0.1"],
        server=True,
    )
    directory = tmp_path_factory.mktemp("tls")
    (directory / "tls.crt").write_bytes(leaf.cert_pem)
    (directory / "tls.key").write_bytes(leaf.key_pem)
    return ca, directory / "tls.crt", directory / "tls.key"


def server_context(certs: tuple[KeyPair, Path, Path]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs[1], certs[2])
    return context


def client_context(certs: tuple[KeyPair, Path, Path]) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=certs[0].cert_pem.decode())


async def test_tls_requests_are_served(certs: tuple[KeyPair, Path, Path]) -> None:
    async with serving(tls=server_context(certs)) as server:
        url = f"https://127.0.0.1:{server.port}/healthz"
        assert await get(url, tls=client_context(certs)) == (200, "ok")
        assert await get(url, tls=client_context(certs)) == (200, "ok")
        await until(lambda: server.stats.held == 0, "the connections to close")


async def test_a_tls_client_that_never_says_hello_is_cut_after_the_header_timeout(
    certs: tuple[KeyPair, Path, Path],
) -> None:
    async with serving(tls=server_context(certs)) as server:
        reader, writer = await open_raw(server)
        started = time.monotonic()
        await until(lambda: server.stats.held == 1, "the connection to be held")
        assert await closed_by_server(reader) == b""
        elapsed = time.monotonic() - started
        await close_raw(writer)
        assert 0.4 <= elapsed < 3, elapsed
        assert server.stats.header_timeouts == 1
        await until(lambda: server.stats.held == 0, "the slot to be free")
        assert await get(f"https://127.0.0.1:{server.port}/healthz", tls=client_context(certs)) == (200, "ok")


async def test_tls_handshakes_in_progress_count_against_the_cap_and_are_evicted(
    certs: tuple[KeyPair, Path, Path],
) -> None:
    limits = HttpLimits(header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=5, max_connections=3)
    async with serving(limits, tls=server_context(certs)) as server:
        silent = [await open_raw(server) for _ in range(3)]
        await until(lambda: server.stats.held == 3, "three handshakes to be held")
        assert await get(f"https://127.0.0.1:{server.port}/healthz", tls=client_context(certs)) == (200, "ok")
        assert server.stats.evicted == 1
        assert await closed_by_server(silent[0][0]) == b""
        for _, writer in silent:
            await close_raw(writer)


async def test_cut_handshakes_free_their_tls_state_at_once(certs: tuple[KeyPair, Path, Path]) -> None:
    # asyncio's TLS layer holds a 256 KiB buffer per connection: one evicted (or cut) in its
    # handshake must free it when cut, not when the cyclic garbage collector next runs.
    limits = HttpLimits(header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=5, max_connections=3)

    def tls_states() -> int:
        return sum(1 for obj in gc.get_objects() if isinstance(obj, SSLProtocol))

    gc.collect()
    gc.disable()
    try:
        async with serving(limits, tls=server_context(certs)) as server:
            silent = [await open_raw(server) for _ in range(8)]
            await until(
                lambda: server.stats.accepted == 8 and server.stats.evicted == 5, "8 accepted, 5 evicted"
            )
            await until(lambda: tls_states() == 3, "only the 3 held connections to keep a TLS state")
            for _, writer in silent:
                await close_raw(writer)
    finally:
        gc.enable()


async def test_a_queued_tls_connection_gets_its_handshake_once_it_has_a_slot(
    certs: tuple[KeyPair, Path, Path],
) -> None:
    gate = asyncio.Event()
    limits = HttpLimits(header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=5, max_connections=1)
    async with serving(limits, tls=server_context(certs), gate=gate) as server:
        url = f"https://127.0.0.1:{server.port}"
        (busy,) = await hold_every_slot(server, 1, tls=client_context(certs))
        queued = asyncio.create_task(get(f"{url}/healthz", tls=client_context(certs)))
        await until(lambda: server.stats.queued == 1, "the second connection to queue")
        assert not queued.done()  # no handshake yet: it holds no TLS state while it waits
        gate.set()
        assert await busy == (200, "released")
        assert await queued == (200, "ok")
        assert (server.stats.queued_total, server.stats.accepted) == (1, 2)


async def test_stopping_cuts_handshakes_in_progress(certs: tuple[KeyPair, Path, Path]) -> None:
    limits = HttpLimits(header_timeout_s=30, body_timeout_s=30, keepalive_timeout_s=30)
    async with serving(limits, tls=server_context(certs)) as server:
        reader, writer = await open_raw(server)
        await until(lambda: server.stats.held == 1, "the connection to be held")
    # Stopped: the silent client was hung up on, and no handshake task is left (conftest checks).
    assert await closed_by_server(reader) == b""
    await close_raw(writer)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="header_timeout_s"):
        HttpLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections"):
        HttpLimits(max_connections=0)
    with pytest.raises(ValueError, match="max_queued"):
        HttpLimits(max_queued=-1)
