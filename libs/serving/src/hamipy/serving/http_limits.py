"""The limits every aiohttp server of ours runs under (``start_bounded_site``): a tenant can reach
each of them on the pod network, so a client that trickles its request, or opens connections by
the thousand, must cost a bounded amount of memory and time.

What aiohttp (3.14) offers is used as is: ``keepalive_timeout`` (an idle kept-alive connection is
closed), the header size limits (``max_line_size``, ``max_field_size``, ``max_headers``: their
defaults bound a request head to about 1 MiB), ``client_max_size`` (per app: the body size) and
``lingering_time`` (how long an unread body is drained after the answer; set to the body timeout).
It has no header or body read timeout and no connection cap, and asyncio's TLS layer allocates a
256 KiB buffer for every accepted connection before its handshake. So every accepted connection
goes through a ``_Connection``: a protocol between the socket's transport and aiohttp's
``RequestHandler`` that counts it and times it from accept on, and, for HTTPS, runs the TLS
handshake itself (``loop.start_tls``) so that a connection can be cut before its handshake ends.

- Header timeout: from accept (TLS handshake included), or on a kept-alive connection from the
  first byte of the next request, until the request reaches the application (line and headers
  parsed). Idle time between requests is the keep-alive timeout's, as Go's ``ReadHeaderTimeout``
  and ``IdleTimeout`` split it.
- Body timeout: from then until the body is complete; a handler still reading it then finds the
  connection cut (answered as 408 to nobody, so aiohttp logs no 500).
- Connection lost mid-request (the client left with its body unfinished or its answer unsent): one
  log line naming the peer and the reason (``start_bounded_site(logger=...)``) and a count
  (``ConnectionStats.client_gone``); the handler's read fails as under the body timeout, with no
  traceback. A body the handler left unread, which aiohttp drains after the answer
  (``lingering_time``), ends with the connection.
- Connection cap and queue (``hamipy.serving.connection_cap`` says who is evicted and who waits):
  a queued connection is not read and has no TLS state yet (a socket and about 1 KiB), and it waits
  at most the header timeout. While connections queue, a held one is closed once its answer is
  sent (``Connection: close``), so each finished request hands its slot on.
- HTTP/2 (``start_bounded_site(http2=...)``, TLS only): a connection whose handshake chose ``h2``
  is handed to a ``hamipy.serving.http2.Http2Session`` instead of aiohttp, and held to the same
  limits per stream (that module's docstring says how). One with a stream open is being served
  (not evicted) even while that stream's body is still coming: the body timeout bounds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from typing import Final, cast

import structlog
from aiohttp import StreamReader, web
from aiohttp.typedefs import Handler

from hamipy.protocol.settings import tuning
from hamipy.serving.connection_cap import ConnectionCap, ConnectionStats
from hamipy.serving.http2 import Http2App, Http2Session

__all__ = ["BoundedServer", "BoundedSite", "HttpLimits", "start_bounded_site"]


@dataclasses.dataclass(frozen=True, slots=True)
class HttpLimits:
    """How long a client may take and how many connections it may hold. Times are in seconds.
    Each is a setting of every service that serves HTTP to the pod network (``--header-timeout``...)."""

    header_timeout_s: float = tuning(
        10.0, "seconds a client gets from connecting (TLS handshake included) to its request headers"
    )
    """Accept (or first byte of a further request) to headers parsed. Our callers (API server,
    kube-scheduler, kubelet) send a request head in one segment; 10 s is the API server's default
    webhook timeout, past which it has given up anyway."""
    body_timeout_s: float = tuning(10.0, "seconds a client gets from its headers to the end of its body")
    """Headers parsed to the whole body received: 16 MiB (the largest body we take) crosses a pod
    network in well under a second."""
    keepalive_timeout_s: float = tuning(75.0, "seconds an idle kept-alive connection stays open")
    """An idle kept-alive connection is closed after this long (nginx's default). Below Go's 90 s
    ``IdleConnTimeout`` the client may find a connection closed under it, which Go retries when
    nothing was written yet; idle connections may go sooner at the cap anyway."""
    max_connections: int = tuning(
        256, "connections held at once per port; beyond it the longest idle or slow one is closed"
    )
    """Connections held at once. A TLS connection costs a few hundred KiB (asyncio's 256 KiB read
    buffer from accept on, then the SSL object and aiohttp's handler), so the cap keeps a flood of
    slow clients within the chart's 256 Mi (docs/benchmarks.md#slow-clients). Our callers keep a few
    tens open (the API servers, one kube-scheduler, the kubelet, Prometheus)."""
    max_queued: int = tuning(
        512,
        "connections that wait for a slot when every held one is serving a request (0: none; a new "
        "connection is then closed at once)",
        flag="max-queued-connections",
    )
    """Each costs a socket and about 1 KiB while it waits, so the default with ``max_connections``
    stays well inside a container's 1,024 open files."""

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (got {self.max_connections})")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0 (got {self.max_queued})")


class _Guard:
    """One server's connections: their cap (``connection_cap``), and the middleware that tells each
    connection when its request reached the application and when the application was done."""

    def __init__(
        self,
        limits: HttpLimits,
        ssl_context: ssl.SSLContext | None,
        *,
        http2: Http2App | None = None,
        shutdown_timeout_s: float = 60.0,
        logger: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self.limits = limits
        self.ssl_context = ssl_context
        self.http2 = http2
        self.shutdown_timeout_s = shutdown_timeout_s
        self.logger = logger
        self.stats = ConnectionStats()
        self.server: web.Server | None = None
        self.stopping = False
        """Set once the server stops: the connections it closes then did not lose their clients."""
        self.cap: ConnectionCap[_Connection] = ConnectionCap(
            limits.max_connections, limits.max_queued, self.stats
        )
        self.by_handler: dict[web.RequestHandler, _Connection] = {}
        self.handshakes: set[asyncio.Task[None]] = set()

        @web.middleware
        async def track_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
            conn = self.by_handler.get(request.protocol)
            if conn is None:
                if request.transport is None:  # lost before its handler could start
                    raise web.HTTPRequestTimeout()
                return await handler(request)  # not one of ours (aiohttp's test client, say)
            conn.request_started(request)
            try:
                response = await handler(request)
            except OSError:  # ConnectionResetError, or the TLS layer's error, from the body's read
                if not conn.lost:
                    raise
                # A limit cut the connection under the handler, or the client left (the connection
                # logged it): nobody is left to answer, and an HTTP error (unlike this exception)
                # is not logged by aiohttp as a crash.
                raise web.HTTPRequestTimeout() from None
            finally:
                conn.request_done()
            if self.cap.queue:
                response.force_close()  # others wait for a slot: hand this one on once answered
            return response

        self.middleware: Final = track_requests

    async def stop(self) -> None:
        """Cut what aiohttp does not know yet: queued connections, and those still in their TLS
        handshake (the queue first, so that no slot freed here is handed on); drain the HTTP/2
        ones (aiohttp drains its own after this)."""
        self.stopping = True
        for conn in list(self.cap.queue):
            conn.cut()
        for conn in [c for c in self.cap.held if not c.serving]:
            conn.cut()
        if self.handshakes:
            await asyncio.wait(list(self.handshakes))
        sessions = [c.http2 for c in self.cap.held if c.http2 is not None]
        if sessions:
            await asyncio.gather(*(s.shutdown(self.shutdown_timeout_s) for s in sessions))


class _Connection(asyncio.Protocol):
    """One accepted connection, between its transport and aiohttp's ``RequestHandler`` (made once
    the connection is admitted and, for HTTPS, its handshake is done). Forwards what the transport
    reports; keeps the connection's one deadline (headers or body)."""

    def __init__(self, guard: _Guard) -> None:
        self._guard = guard
        self._loop = asyncio.get_running_loop()
        self._raw: asyncio.Transport | None = None
        self._inner: web.RequestHandler | None = None
        self.http2: Http2Session | None = None
        """Instead of ``_inner`` when the TLS handshake selected HTTP/2."""
        self._early: list[bytes] = []
        """Bytes decrypted between the handshake's end and ``_connect`` (the task's next step)."""
        self._handshake: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None
        self._request: web.BaseRequest | None = None
        """The HTTP/1.1 request in flight (for the log line if the client leaves)."""
        self._unread: StreamReader | None = None
        """The answered request's body, while aiohttp may still be draining it."""
        self._in_flight = False
        """A request (or an HTTP/2 stream) is between its head and its answer."""
        self._idle = False
        self._closed = False

    @property
    def lost(self) -> bool:
        """Closed, by us or by the peer."""
        return self._closed

    @property
    def serving(self) -> bool:
        """Whether aiohttp or an ``Http2Session`` has it (and closes it on shutdown)."""
        return self._inner is not None or self.http2 is not None

    # -- the transport's side -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw = cast(asyncio.Transport, transport)
        self._raw = raw
        verdict = self._guard.cap.admit(self)
        if verdict == "refused":
            self._closed = True
            raw.abort()
            return
        if verdict == "queued":
            raw.pause_reading()  # unread until it has a slot
            self._timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._queue_late)
            return
        self._start(raw)

    def admitted(self) -> None:
        """Out of the queue into a slot (the guard counts it held): served from now on, its request
        head timed afresh."""
        assert self._raw is not None
        self._cancel_timer()
        self._start(self._raw)
        if self._guard.ssl_context is None:
            self._raw.resume_reading()

    def _start(self, raw: asyncio.Transport) -> None:
        self._await_headers()
        context = self._guard.ssl_context
        if context is None:
            self._connect(raw)
            return
        # Nothing is read until the TLS layer owns the socket (start_tls swaps the protocol).
        raw.pause_reading()
        self._handshake = self._loop.create_task(self._start_tls(raw, context))
        self._guard.handshakes.add(self._handshake)
        self._handshake.add_done_callback(self._handshake_done)

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        timeout = self._guard.limits.header_timeout_s
        try:
            tls = await self._loop.start_tls(
                raw,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=timeout,
                ssl_shutdown_timeout=timeout,
            )
        except OSError:  # a failed handshake, or the peer left: nothing to serve
            tls = None
        except BaseException:  # cancelled: the connection was cut (start_tls closed the socket)
            self._forget()
            raise
        if tls is None or self._closed:  # None: the connection was cut during the handshake
            self._forget()
            return
        self._connect(tls)

    def _handshake_done(self, task: asyncio.Task[None]) -> None:
        # The finished task keeps its exception (a cancellation: the connection was cut), whose
        # frames hold this connection and its TLS state (a 256 KiB buffer): let go of the task, or
        # only the cyclic garbage collector, much later, would free them.
        self._guard.handshakes.discard(task)
        self._handshake = None

    def data_received(self, data: bytes) -> None:
        if self.http2 is not None:  # frames of any stream, or pings: the session times streams
            self.http2.data_received(data)
            return
        if self._idle:
            self._await_headers()  # the first byte of the next request
        if self._inner is None:
            self._early.append(data)
        else:
            self._inner.data_received(data)

    def eof_received(self) -> None:
        # None: the transport closes on end of stream, as aiohttp's own handler has it.
        inner = self.http2 or self._inner
        if inner is not None:
            inner.eof_received()

    def pause_writing(self) -> None:
        inner = self.http2 or self._inner
        if inner is not None:
            inner.pause_writing()

    def resume_writing(self) -> None:
        inner = self.http2 or self._inner
        if inner is not None:
            inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._in_flight and not self._closed and not self._guard.stopping:
            self._client_gone(exc)
        self._forget()
        inner = self.http2 or self._inner
        if inner is not None:
            inner.connection_lost(exc)
        if self._inner is not None:
            # Only now: a request parsed before the connection was cut may reach the middleware
            # between the cut and this, and must find its connection (and that it is lost).
            self._guard.by_handler.pop(self._inner, None)
        unread, self._unread = self._unread, None
        if unread is not None and not unread.is_eof():
            # aiohttp drains a body its handler left unread (``lingering_time``) but is not woken
            # when the connection goes: its task would wait out the body timeout, past the slot's
            # release and even the server's shutdown. The end of the body ends the drain.
            unread.feed_eof()

    # -- the application's side (the guard's middleware) -----------------------------------------

    def request_started(self, request: web.BaseRequest) -> None:
        """The request's line and headers are parsed: its body (if still coming) is timed now, and
        the connection stays evictable, in its place among the senders, until the body is whole."""
        pipelined = self._idle  # parsed from bytes that came with the previous request
        self._idle = False
        self._in_flight = True
        self._request = request
        self._unread = None
        self._cancel_timer()
        body = request.content
        if self._closed or body.is_eof():
            self._guard.cap.busy(self)
            return
        if pipelined:
            self._guard.cap.send(self)
        self._body = body
        self._timer = self._loop.call_later(self._guard.limits.body_timeout_s, self._body_late)
        body.on_eof(self._body_arrived)

    def _body_arrived(self) -> None:
        if self._body is not None and not self._closed:
            self._body = None
            self._cancel_timer()
            self._guard.cap.busy(self)

    def request_done(self) -> None:
        """The handler returned: idle until the next request's first byte, for at most the
        keep-alive time (which also bounds a client that does not read its answer)."""
        self._cancel_timer()
        self._body = None
        if self._request is not None and not self._request.content.is_eof():
            self._unread = self._request.content
        self._request = None
        self._in_flight = False
        if not self._closed:
            self._idle = True
            self._timer = self._loop.call_later(self._guard.limits.keepalive_timeout_s, self._idle_late)
            self._guard.cap.rest(self)

    # -- an HTTP/2 session's streams (``http2.Slot``) ----------------------------------------------

    def busy(self) -> None:
        """A stream opened on an idle HTTP/2 connection."""
        self._idle = False
        self._in_flight = True
        self._cancel_timer()
        self._guard.cap.busy(self)

    def idle(self) -> None:
        """Its last stream was answered: kept alive for the keep-alive time."""
        self.request_done()

    def late(self) -> None:
        """A stream's body, or the peer's taking of an answer, outlasted the body timeout."""
        if not self._closed:
            self._guard.stats.body_timeouts += 1
            self.cut()

    # -- deadlines and closing ------------------------------------------------------------------

    def cut(self) -> None:
        """Close now, dropping whatever is unsent; the slot is free at once."""
        self._forget()
        if self._raw is not None:
            self._raw.abort()

    def _connect(self, transport: asyncio.Transport) -> None:
        tls = transport.get_extra_info("ssl_object")
        http2 = self._guard.http2
        if http2 is not None and tls is not None and tls.selected_alpn_protocol() == "h2":
            limits = self._guard.limits
            self.http2 = Http2Session(transport, http2, slot=self, body_timeout_s=limits.body_timeout_s)
            self._guard.stats.http2 += 1
            early, self._early = self._early, []
            for chunk in early:
                self.http2.data_received(chunk)
            return
        server = self._guard.server
        assert server is not None, "the site sets it before accepting"
        inner = server()
        self._inner = inner
        self._guard.by_handler[inner] = self
        inner.connection_made(transport)
        early, self._early = self._early, []
        for chunk in early:
            inner.data_received(chunk)

    def _await_headers(self) -> None:
        self._idle = False
        self._cancel_timer()
        self._timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._headers_late)
        self._guard.cap.send(self)

    def _client_gone(self, exc: Exception | None) -> None:
        """The peer closed (or reset) the connection with a request in flight: counted, and one
        line naming the peer and the reason (aiohttp would log the handler's failed read as a
        crash, with its traceback, were it not turned into an answer to nobody)."""
        self._guard.stats.client_gone += 1
        logger = self._guard.logger
        if logger is None:
            return
        raw = self._raw
        request = self._request
        what = (
            {"method": request.method, "path": request.path, "body_complete": self._body is None}
            if request is not None
            else {"http2": True}
        )
        logger.info(
            "client left mid-request",
            peer=_address(raw.get_extra_info("peername") if raw is not None else None),
            reason="closed by the client" if exc is None else f"{type(exc).__name__}: {exc}",
            **what,
        )

    def _headers_late(self) -> None:
        self._timer = None
        self._guard.stats.header_timeouts += 1
        self.cut()

    def _queue_late(self) -> None:
        self._timer = None
        self._guard.stats.queue_timeouts += 1
        self.cut()

    def _idle_late(self) -> None:
        self._timer = None
        self._guard.stats.idle_timeouts += 1
        if self.http2 is not None:  # GOAWAY first: the peer sends nothing more on it, and retries
            self.http2.close()  # a request that crossed it
            self._forget()
            return
        self.cut()

    def _body_late(self) -> None:
        self._timer = None
        if self._body is not None and not self._body.is_eof():
            self._guard.stats.body_timeouts += 1
            self.cut()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _forget(self) -> None:
        """Stop timing and counting it (once; the transport may still report its loss later)."""
        if self._closed:
            return
        self._closed = True
        self._cancel_timer()
        self._body = None
        self._request = None
        self._guard.cap.release(self)
        handshake = self._handshake
        if handshake is not None and handshake is not asyncio.current_task():
            handshake.cancel()  # start_tls then closes the socket and frees its TLS state


def _address(peer: object) -> str | None:
    """``host:port`` of a socket's peer name (``[host]:port`` for IPv6)."""
    if not isinstance(peer, tuple) or len(peer) < 2:
        return None
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class BoundedSite(web.BaseSite):
    """A TCP site (HTTP, or HTTPS with ``ssl_context``) whose connections go through ``_Connection``:
    aiohttp's ``TCPSite`` but for the protocol factory and TLS, which the connection runs itself."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        guard: _Guard,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard
        self._bound: int | None = None

    @property
    def name(self) -> str:
        scheme = "https" if self._guard.ssl_context is not None else "http"
        return f"{scheme}://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (the requested one before ``start``)."""
        return self._port if self._bound is None else self._bound

    async def start(self) -> None:
        await super().start()
        guard = self._guard
        guard.server = self._runner.server
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Connection(guard), self._host, self._port, backlog=self._backlog
        )
        self._server = server
        self._bound = int(server.sockets[0].getsockname()[1]) if server.sockets else self._port

    async def stop(self) -> None:
        await super().stop()
        await self._guard.stop()


@dataclasses.dataclass(frozen=True, slots=True)
class BoundedServer:
    """One app served by ``start_bounded_site``; ``close()`` stops it (draining in-flight requests)."""

    runner: web.AppRunner
    site: BoundedSite
    stats: ConnectionStats

    @property
    def port(self) -> int:
        return self.site.port

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_bounded_site(
    app: web.Application,
    *,
    host: str,
    port: int,
    limits: HttpLimits,
    ssl_context: ssl.SSLContext | None = None,
    shutdown_timeout_s: float = 60.0,
    http2: Http2App | None = None,
    logger: structlog.typing.FilteringBoundLogger | None = None,
) -> BoundedServer:
    """Serve ``app`` on ``host:port`` (0: a free port) under ``limits``, over TLS with
    ``ssl_context``. ``app`` must not be started yet: a middleware of ours is put first in it.
    ``logger`` gets a line for each client that leaves mid-request (none without it; each is
    counted either way).

    With ``http2`` (and ``ssl_context``) a client may choose HTTP/2 in the handshake (ALPN, set on
    ``ssl_context`` here); its requests are then answered by ``http2`` (``hamipy.serving.http2``)
    instead of ``app``, under the same limits."""
    if http2 is not None:
        if ssl_context is None:
            raise ValueError("HTTP/2 is offered over TLS only (ALPN): give an ssl_context")
        ssl_context.set_alpn_protocols(["h2", "http/1.1"])
    guard = _Guard(limits, ssl_context, http2=http2, shutdown_timeout_s=shutdown_timeout_s, logger=logger)
    app.middlewares.insert(0, guard.middleware)
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        keepalive_timeout=limits.keepalive_timeout_s,
        lingering_time=limits.body_timeout_s,
    )
    await runner.setup()
    site = BoundedSite(runner, host, port, guard=guard)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return BoundedServer(runner, site, guard.stats)
