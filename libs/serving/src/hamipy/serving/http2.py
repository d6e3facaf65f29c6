"""HTTP/2 on a bounded server's TLS connections (ALPN ``h2``), for a caller that sends many small
requests at once: kube-scheduler's Go client keeps only 2 idle HTTP/1.1 connections per extender, so
under a burst it opens (and closes) a TLS connection for most requests, and the handshake, mostly
the check of its client certificate, costs the extender more than the request. Over HTTP/2 the
same client multiplexes every request on one connection (docs/extender.md, "TLS handshakes").

The framing is the ``h2`` library's (a sans-I/O state machine); this module is the I/O around it:
one ``Http2Session`` per connection, fed by the bounded server's ``_Connection`` once its handshake
selected ``h2``. A request is read whole (at most ``Http2App.max_body_bytes``) and handed to
``Http2App.respond``; the answer is sent within the peer's flow-control window.

What arrives is framed a slice (about one 1,000-node filter) a loop turn. The peer sends its
requests back to back on this one connection, and ``h2`` frames in Python, several times the cost
of aiohttp's HTTP/1.1 parser in C (``tests/bench/bench_http_framing.py``). Framing a whole read at
once would make one step of several requests, and filters on other connections would wait behind
it; a slice a turn keeps a step to about one request
(docs/benchmarks.md#http2-against-http11-on-the-decision-port).

The limits of ``hamipy.serving.http_limits`` carry over: the connection is busy while a stream is
open and idle (kept alive for ``keepalive_timeout_s``, then closed with GOAWAY) when none is; a
stream's body must arrive within ``body_timeout_s`` of its headers, and an answer the peer does not
take (flow control, or a socket it does not read) within ``body_timeout_s``, or the connection is
cut. At most ``MAX_STREAMS`` requests are handled at once per connection: the peer is told so in
SETTINGS, and a stream past it (a peer that resets its streams to open more) is refused with
REFUSED_STREAM, which Go retries. A handler is never cancelled by its stream's reset (a bind
half done is finished); its answer is dropped. Header blocks are bounded by ``h2`` (64 KiB decoded,
64 CONTINUATION frames). On shutdown new streams are refused, those in flight are answered (for
at most the shutdown timeout), then GOAWAY; ``h2`` cannot answer a stream once GOAWAY is sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final, Protocol

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import structlog

__all__ = ["MAX_STREAMS", "Http2Answer", "Http2App", "Http2Request", "Http2Session"]

MAX_STREAMS: Final = 100
"""Requests handled at once on one connection (Go's client opens another connection past it)."""
_WINDOW: Final = 1 << 20
"""The initial flow-control window of each stream: a request body of up to 1 MiB is sent without
waiting for a WINDOW_UPDATE (the connection's window is raised to ``MAX_STREAMS`` of these)."""
_MAX_HEADER_LIST: Final = 1 << 16
_SLICE: Final = 16_384 + 9
"""Bytes framed a loop turn: one full DATA frame (h2's default size) and its header, about one
filter at 1,000 nodes (the node names); many binds."""
_INBOX_MAX: Final = 256 * 1024
"""Received but not yet framed past this, the socket is not read until it is (asyncio reads 256 KiB
at a time)."""

_log = structlog.get_logger("hamipy.serving.http2")


@dataclasses.dataclass(frozen=True, slots=True)
class Http2Request:
    method: str
    path: str
    """Without the query."""
    query: str
    headers: Mapping[str, str]
    """Lower-case names (HTTP/2 has no others); pseudo-headers left out."""
    body: bytes
    too_large: bool
    """The body was longer than ``Http2App.max_body_bytes`` (``body`` is then empty)."""
    remote: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class Http2Answer:
    status: int
    body: bytes | Sequence[bytes] = b""
    """Whole, or in chunks sent one after another."""
    content_type: str | None = "application/json"
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Http2App:
    """What a server answers over HTTP/2: ``respond`` for each request (an exception is answered
    500 and logged), bodies up to ``max_body_bytes``."""

    respond: Callable[[Http2Request], Awaitable[Http2Answer]]
    max_body_bytes: int


class Slot(Protocol):
    """The connection's side of the limits (``http_limits._Connection``)."""

    def busy(self) -> None:
        """A stream opened while none was: the idle (keep-alive) timer stops."""

    def idle(self) -> None:
        """The last open stream was answered: the keep-alive timer starts."""

    def late(self) -> None:
        """A body or an answer took longer than the body timeout: the connection is cut."""


@dataclasses.dataclass(slots=True)
class _Stream:
    headers: list[tuple[str, str]]
    chunks: list[bytes] = dataclasses.field(default_factory=list)
    size: int = 0
    too_large: bool = False
    timer: asyncio.TimerHandle | None = None
    reset: bool = False


class Http2Session:
    """One HTTP/2 connection over ``transport`` (TLS, ``h2`` selected): what the transport reports
    is forwarded here by the connection that owns it. The server's preface is sent at once."""

    def __init__(
        self,
        transport: asyncio.Transport,
        app: Http2App,
        *,
        slot: Slot,
        body_timeout_s: float,
    ) -> None:
        self._transport = transport
        self._app = app
        self._slot = slot
        self._body_timeout_s = body_timeout_s
        self._loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        self._remote = str(peer[0]) if isinstance(peer, tuple) and peer else None
        # h2's header checks and normalisation are a third of its time per request; nothing here
        # passes a header on (a route reads :method, :path and one header by name), and ours are fixed.
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding="utf-8",
            validate_inbound_headers=False,
            normalize_inbound_headers=False,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self._h2 = h2.connection.H2Connection(config)
        self._h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: _MAX_HEADER_LIST,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW,
            },
        )
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(MAX_STREAMS * _WINDOW - 65_535)
        self._streams: dict[int, _Stream] = {}
        """Streams from their headers until their answer is sent or dropped (a reset stream whose
        handler runs stays until the handler returns)."""
        self._handlers: set[asyncio.Task[None]] = set()
        self._window = asyncio.Event()
        """Set when the peer may take more: a WINDOW_UPDATE, or the socket writable again."""
        self._writable = True
        self._inbox = bytearray()
        """Received, not yet framed (``_take``)."""
        self._pump: asyncio.Handle | None = None
        self._reading_paused = False
        self._draining = False
        self._closed = False
        self.requests = 0
        """Requests handed to the app (tests and stats read it)."""
        self._flush()

    # -- the transport's side -------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        self._inbox += data
        if len(self._inbox) > _INBOX_MAX and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()
        if self._pump is None:
            self._pump = self._loop.call_soon(self._take)

    def _take(self) -> None:
        """Frame what arrived, a slice a loop turn: several requests that came in one read (the
        peer sends them back to back on this one connection) are then read and started a turn
        apart, with other connections' requests in between, as on separate connections."""
        self._pump = None
        if self._closed:
            return
        chunk = bytes(self._inbox[:_SLICE])
        del self._inbox[:_SLICE]
        if self._inbox:
            self._pump = self._loop.call_soon(self._take)
        elif self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        self._receive(chunk)

    def _receive(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            # h2 has queued a GOAWAY naming the error: send it, then close.
            _log.info("http2 protocol error", remote=self._remote, error=str(exc))
            self._flush()
            self._close()
            return
        for event in events:
            self._handle(event)
        self._flush()

    def eof_received(self) -> None:
        self._close()

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        self._window.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._inbox.clear()
        self._window.set()  # senders find the connection gone
        for stream in self._streams.values():
            _cancel(stream)

    # -- the server's side ----------------------------------------------------------------------

    def close(self) -> None:
        """Close now with GOAWAY (the keep-alive timer's end: no stream is open)."""
        if not self._closed:
            self._h2.close_connection()
            self._flush()
        self._close()

    async def shutdown(self, timeout_s: float) -> None:
        """Refuse new streams, answer those in flight (for at most ``timeout_s``), then GOAWAY."""
        self._draining = True
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=timeout_s)
        self.close()

    # -- frames ---------------------------------------------------------------------------------

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._opened(event)
        elif isinstance(event, h2.events.DataReceived):
            self._data(event)
        elif isinstance(event, h2.events.StreamEnded):
            self._ended(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self._reset(event.stream_id)
        elif isinstance(event, h2.events.WindowUpdated):
            self._window.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._close()  # the peer's GOAWAY: h2 sends nothing more on this connection

    def _opened(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        # Counted until answered, reset or not: a reset does not stop the handler.
        if self._draining or len(self._streams) >= MAX_STREAMS:
            self._h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if not self._streams:
            self._slot.busy()
        headers = [(_text(name), _text(value)) for name, value in event.headers]
        stream = _Stream(headers)
        stream.timer = self._loop.call_later(self._body_timeout_s, self._slot.late)
        self._streams[sid] = stream

    def _data(self, event: h2.events.DataReceived) -> None:
        sid = event.stream_id
        # The window is given back at once: a body past the limit is dropped, not stalled.
        self._h2.acknowledge_received_data(event.flow_controlled_length or 0, sid)
        stream = self._streams.get(sid)
        if stream is None or stream.too_large or not event.data:
            return
        stream.size += len(event.data)
        if stream.size > self._app.max_body_bytes:
            stream.too_large = True
            stream.chunks.clear()
        else:
            stream.chunks.append(event.data)

    def _ended(self, sid: int | None) -> None:
        stream = self._streams.get(sid) if sid is not None else None
        if stream is None or sid is None or stream.timer is None:
            return
        stream.timer.cancel()
        stream.timer = None
        task = self._loop.create_task(self._answer(sid, stream))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def _reset(self, sid: int | None) -> None:
        stream = self._streams.get(sid) if sid is not None else None
        if stream is None or sid is None:
            return
        stream.reset = True
        if stream.timer is not None:  # not handed to the app yet: forgotten now
            _cancel(stream)
            self._done(sid)

    # -- answers --------------------------------------------------------------------------------

    async def _answer(self, sid: int, stream: _Stream) -> None:
        try:
            request = self._request(stream)
            self.requests += 1
            try:
                answer = await self._app.respond(request)
            except Exception:
                _log.exception("http2 handler failed", remote=self._remote, path=request.path)
                answer = Http2Answer(500, b'{"Error": "internal error"}')
            if not stream.reset and not self._closed:
                await self._send(sid, answer, head=request.method == "HEAD")
        finally:
            self._done(sid)

    def _request(self, stream: _Stream) -> Http2Request:
        pseudo: dict[str, str] = {}
        headers: dict[str, str] = {}
        for name, value in stream.headers:
            if name.startswith(":"):
                pseudo[name] = value
            else:
                headers[name] = value
        path, _, query = pseudo.get(":path", "/").partition("?")
        body = b"".join(stream.chunks)
        stream.chunks.clear()
        return Http2Request(
            method=pseudo.get(":method", ""),
            path=path,
            query=query,
            headers=headers,
            body=body,
            too_large=stream.too_large,
            remote=self._remote,
        )

    async def _send(self, sid: int, answer: Http2Answer, *, head: bool) -> None:
        """Send ``answer`` on stream ``sid``; to a HEAD request, its headers alone (RFC 9110 9.3.2:
        the length is the body's a GET would get)."""
        chunks = (answer.body,) if isinstance(answer.body, bytes) else answer.body
        length = sum(len(chunk) for chunk in chunks)
        headers = [(":status", str(answer.status)), ("content-length", str(length))]
        if answer.content_type is not None:
            headers.append(("content-type", answer.content_type))
        headers.extend((name.lower(), value) for name, value in answer.headers.items())
        left = 0 if head else length
        try:
            self._h2.send_headers(sid, headers, end_stream=not left)
            self._flush()
            for chunk in chunks if left else ():
                view = memoryview(chunk)
                while view:
                    window = self._h2.local_flow_control_window(sid)
                    size = min(len(view), window, self._h2.max_outbound_frame_size)
                    if size <= 0 or not self._writable:
                        if not await self._wait_window():
                            return
                        continue
                    left -= size
                    self._h2.send_data(sid, view[:size].tobytes(), end_stream=not left)
                    self._flush()
                    view = view[size:]
        except h2.exceptions.H2Error:  # the stream was reset or the connection closed meanwhile
            return

    async def _wait_window(self) -> bool:
        """Wait until the peer may take more; False when the connection is gone. A peer that takes
        nothing for the body timeout has the connection cut."""
        self._window.clear()
        try:
            async with asyncio.timeout(self._body_timeout_s):
                await self._window.wait()
        except TimeoutError:
            self._slot.late()
            return False
        return not self._closed

    def _done(self, sid: int) -> None:
        if self._streams.pop(sid, None) is not None and not self._streams and not self._closed:
            self._slot.idle()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and not self._closed:
            self._transport.write(data)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.clear()
            self._window.set()
            self._transport.close()


def _text(value: str | bytes) -> str:
    """A header name or value as text (``h2`` gives text with ``header_encoding``; typed as either)."""
    return value.decode() if isinstance(value, bytes) else value


def _cancel(stream: _Stream) -> None:
    if stream.timer is not None:
        stream.timer.cancel()
        stream.timer = None
