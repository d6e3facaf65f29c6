"""What the extender's server spends on HTTP itself per request, HTTP/2 against HTTP/1.1.

Over TLS the extender offers kube-scheduler HTTP/2 (``hamipy.serving.http2``, the ``h2``
library's pure-Python framing), which spares most of a burst's TLS handshakes
(``bench_tls_handshake.py``, ``bench_e2e.py --tls``) but frames each request in Python, where
aiohttp parses HTTP/1.1 in C. This times one request and its answer through each server, in
process and without TLS (the record layer costs the same either way): a filter's body and answer
the size of a 1,000-node cluster's (kube-scheduler sends the node names), the handler a canned
answer, the time from the request's bytes to the answer's bytes written. Go's client reuses its
HPACK table, as here.

    .venv/bin/python tests/bench/bench_http_framing.py [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import h2.config
import h2.connection
import h2.events
from _results import percentiles_us, record
from aiohttp import web

from hamipy.serving.http2 import Http2Answer, Http2App, Http2Request, Http2Session

NODES = 1000
HEADERS = [
    (":method", "POST"),
    (":path", "/filter"),
    (":scheme", "https"),
    (":authority", "extender.hami-system.svc:8888"),
    ("content-type", "application/json"),
    ("accept-encoding", "gzip"),
    ("user-agent", "Go-http-client/2.0"),
]
WARMUP = 50


class _Transport(asyncio.Transport):
    """Keeps what the server writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.out.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        self.out.extend(bytes(chunk) for chunk in chunks)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name in ("peername", "sockname") else default

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0


class _Slot:
    def busy(self) -> None: ...

    def idle(self) -> None: ...

    def late(self) -> None: ...


def payloads() -> tuple[bytes, bytes]:
    names = [f"gpu-node-{i:04d}" for i in range(NODES)]
    pod = {"metadata": {"name": "trainer-0", "namespace": "team-a", "uid": "0" * 36}, "spec": {}}
    return json.dumps({"Pod": pod, "NodeNames": names}).encode(), json.dumps(
        {"NodeNames": names, "FailedNodes": {}, "Error": ""}
    ).encode()


async def _turns() -> None:
    """Let the handler's task run and its answer be written."""
    for _ in range(4):
        await asyncio.sleep(0)


async def time_http2(requests: int, body: bytes, answer: bytes) -> list[float]:
    async def respond(request: Http2Request) -> Http2Answer:
        return Http2Answer(200, answer)

    transport = _Transport()
    server = Http2Session(transport, Http2App(respond, 1 << 24), slot=_Slot(), body_timeout_s=10)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    server.data_received(client.data_to_send())
    samples = []
    for i in range(requests + WARMUP):
        client.receive_data(b"".join(transport.out))
        transport.out.clear()
        server.data_received(client.data_to_send())  # the client's SETTINGS ack, WINDOW_UPDATEs
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, HEADERS)
        for start in range(0, len(body), 16384):
            end = start + 16384 >= len(body)
            client.send_data(sid, body[start : start + 16384], end_stream=end)
        data = client.data_to_send()
        begin = time.perf_counter()
        server.data_received(data)
        await _turns()
        if i >= WARMUP:
            samples.append(time.perf_counter() - begin)
        for event in client.receive_data(b"".join(transport.out)):
            if isinstance(event, h2.events.DataReceived):
                client.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
        transport.out.clear()
    assert server.requests == requests + WARMUP
    return samples


async def time_http1(requests: int, body: bytes, answer: bytes) -> list[float]:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/filter", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    transport = _Transport()
    protocol = runner.server()
    protocol.connection_made(transport)
    head = (
        "POST /filter HTTP/1.1\r\nHost: extender.hami-system.svc:8888\r\nUser-Agent: Go-http-client/1.1\r\n"
        f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\nAccept-Encoding: gzip\r\n\r\n"
    )
    request = head.encode() + body
    samples = []
    try:
        for i in range(requests + WARMUP):
            begin = time.perf_counter()
            protocol.data_received(request)
            await _turns()
            if i >= WARMUP:
                samples.append(time.perf_counter() - begin)
            assert transport.out, "no answer was written"
            transport.out.clear()
    finally:
        await runner.cleanup()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    body, answer = payloads()
    figures: dict[str, Any] = {"body_bytes": len(body), "answer_bytes": len(answer)}
    for name, timer in (("http2", time_http2), ("http1", time_http1)):
        figures[name] = percentiles_us(asyncio.run(timer(args.requests, body, answer)))
    record("http_framing", figures)


if __name__ == "__main__":
    main()
