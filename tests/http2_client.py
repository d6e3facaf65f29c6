"""A small HTTP/2 client over TLS for tests (the ``h2`` state machine over an asyncio stream), with
the controls a well-behaved client library hides: open a stream without ending it, reset it, send
raw bytes, shrink the window it grants."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl

import h2.config
import h2.connection
import h2.events
import h2.settings

__all__ = ["H2Client", "H2Response"]


@dataclasses.dataclass
class H2Response:
    status: int = 0
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytes = b""
    reset: int | None = None
    """The server's RST_STREAM error code, when it reset the stream instead of answering."""


class H2Client:
    """One HTTP/2 connection; ``close()`` when done. ``goaway`` is the server's GOAWAY error code
    once received; ``closed`` is set when the server closed the connection."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, window: int | None
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        if window is not None:
            self.conn.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
            )
        self.conn.initiate_connection()
        self.responses: dict[int, H2Response] = {}
        self.done: dict[int, asyncio.Future[H2Response]] = {}
        self.goaway: int | None = None
        self.closed = asyncio.Event()
        self.settings = asyncio.Event()
        """Set once the server's SETTINGS arrived (``remote_settings`` then holds them)."""
        self.flush()
        self._reading = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, port: int, tls: ssl.SSLContext, *, window: int | None = None) -> H2Client:
        """Connect to 127.0.0.1:``port`` offering only ``h2`` (set on ``tls``, which keeps it)."""
        tls.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
        ssl_object = writer.get_extra_info("ssl_object")
        assert ssl_object.selected_alpn_protocol() == "h2", "the server did not choose HTTP/2"
        client = cls(reader, writer, window)
        # Its SETTINGS (and window) first: a body larger than HTTP/2's default window can then go.
        await asyncio.wait_for(client.settings.wait(), 5)
        return client

    def open(self, method: str, path: str, body: bytes = b"", *, end: bool = True, flush: bool = True) -> int:
        """Send a request's headers (and ``body``); ``end`` False leaves the stream open; ``flush``
        False keeps the frames for the next ``flush()`` (several requests in one write)."""
        sid = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":path", path), (":scheme", "https"), (":authority", "test")]
        self.responses[sid] = H2Response()
        future: asyncio.Future[H2Response] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieved)  # a stream nobody awaits may fail when the server closes
        self.done[sid] = future
        self.conn.send_headers(sid, headers, end_stream=end and not body)
        view = memoryview(body)
        while view:
            size = min(len(view), self.conn.max_outbound_frame_size)
            self.conn.send_data(sid, view[:size].tobytes(), end_stream=end and size == len(view))
            view = view[size:]
        if flush:
            self.flush()
        return sid

    def reset(self, sid: int) -> None:
        self.conn.reset_stream(sid)
        self.flush()

    async def response(self, sid: int, timeout_s: float = 5.0) -> H2Response:
        return await asyncio.wait_for(asyncio.shield(self.done[sid]), timeout_s)

    async def request(self, method: str, path: str, body: bytes = b"") -> H2Response:
        return await self.response(self.open(method, path, body))

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)

    async def _read(self) -> None:
        try:
            while data := await self.reader.read(65536):
                for event in self.conn.receive_data(data):
                    self._handle(event)
                self.flush()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            self.closed.set()
            for future in self.done.values():
                if not future.done():
                    future.set_exception(ConnectionError("the server closed the connection"))

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RemoteSettingsChanged):
            self.settings.set()
        elif isinstance(event, h2.events.ResponseReceived):
            response = self.responses[event.stream_id]
            for raw_name, raw_value in event.headers or []:
                name, value = _text(raw_name), _text(raw_value)
                if name == ":status":
                    response.status = int(value)
                else:
                    response.headers[name] = value
        elif isinstance(event, h2.events.DataReceived):
            self.responses[event.stream_id].body += event.data or b""
            self.conn.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self._finish(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self.responses[event.stream_id].reset = int(event.error_code or 0)
            self._finish(event.stream_id)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = int(event.error_code or 0)

    def _finish(self, sid: int) -> None:
        future = self.done.get(sid)
        if future is not None and not future.done():
            future.set_result(self.responses[sid])

    async def close(self) -> None:
        self._reading.cancel()
        self.writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()
        await asyncio.gather(self._reading, return_exceptions=True)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _retrieved(future: asyncio.Future[H2Response]) -> None:
    if not future.cancelled():
        future.exception()
