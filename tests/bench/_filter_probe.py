"""The filter probe of ``bench_e2e.py --filter-probe``, in a process of its own (as kube-scheduler
is): the bench process's own loop, busy creating pods and reading their watch, would otherwise add
its lag to every sample.

``python _filter_probe.py URL INTERVAL_S [CA CERT KEY]``; reads one line from stdin, the ``/filter``
body, then POSTs it every ``INTERVAL_S`` until stdin closes, and prints ``{"wall": [...], "arrival": [...]}``
(seconds): per sample, from the send to the answer read (``wall``), and to the kernel's receive
time of the answer's last packet (``arrival``: what is left once the probe's own wait for its CPU,
which it shares with the extender, is taken out).

A blocking HTTP/1.1 client on one kept-alive connection, as cheap per request as Go's: with
aiohttp's client the probe's own Python would add to every sample on the CPU it shares with the
extender, and the median would be partly the probe's. Written here rather than with
``http.client`` because the arrival stamp comes with ``recvmsg``'s ancillary data. An ``https`` URL
is asked over TLS with the client certificate ``CERT``/``KEY`` (the extender's decision port demands
one, as the chart serves it), the server's checked against ``CA``: the TLS runs in memory
(``ssl.MemoryBIO``) over the same socket, so the arrival stamps stay the kernel's.

The extender closes an idle kept-alive connection when kube-scheduler's binds fill its connection
cap (``hamipy.serving.http_limits``); a probe that meets its connection closed asks again on a new
one, as Go's client does, and that sample includes the new connection.
"""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import struct
import sys
import time
from urllib.parse import urlsplit

_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; Python names it from 3.13 on
_TIMEOUT_S = 30.0


class _Closed(Exception):
    """The extender closed the kept-alive connection (its connection cap, or a restart)."""


class Probe:
    """One kept-alive connection to the extender, and the ``/filter`` request sent on it."""

    def __init__(self, url: str, payload: bytes, tls: ssl.SSLContext | None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname is None or parts.port is None:
            raise SystemExit(f"probe: want http(s)://HOST:PORT, got {url!r}")
        if (parts.scheme == "https") != (tls is not None):
            raise SystemExit("probe: an https URL needs CA CERT KEY, and only it")
        self.address = (parts.hostname, parts.port)
        self.tls = tls
        self.request = (
            f"POST /filter HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        self.sock, self.session = self._connect()

    def _connect(self) -> tuple[socket.socket, _Tls | None]:
        sock = socket.create_connection(self.address, timeout=_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        session = None if self.tls is None else _Tls(self.tls, sock, self.address[0])
        return sock, session

    def sample(self) -> tuple[float, float]:
        """One ``/filter``: (wall, arrival) seconds, once more on a new connection if closed."""
        for attempt in (1, 2):
            try:
                return self._ask()
            except (_Closed, ConnectionError):
                self.sock.close()
                self.sock, self.session = self._connect()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _ask(self) -> tuple[float, float]:
        sent_wall, sent = time.time_ns(), time.perf_counter_ns()
        self.sock.sendall(self.request if self.session is None else self.session.seal(self.request))
        buffer, arrived, length = b"", 0, -1
        while length < 0 or len(buffer) < length:
            data, stamp = _receive(self.sock)
            arrived = stamp or arrived
            buffer += data if self.session is None else self.session.open(data)
            if length < 0 and b"\r\n\r\n" in buffer:
                length = _answer_length(buffer)
        done = time.perf_counter_ns()
        return (done - sent) / 1e9, (arrived - sent_wall) / 1e9 if arrived else (done - sent) / 1e9


def _receive(sock: socket.socket) -> tuple[bytes, int]:
    """What the socket has (``_Closed`` when the peer closed it), and the kernel's receive time of
    its last packet (epoch ns; 0 when the kernel gave none)."""
    data, ancillary, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(16))
    if not data:
        raise _Closed
    arrived = 0
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
            seconds, nanoseconds = struct.unpack("qq", value[:16])
            arrived = seconds * 10**9 + nanoseconds
    return data, arrived


class _Tls:
    """A TLS client session in memory over ``sock``: the handshake at once, then ``seal`` what to
    send and ``open`` what came."""

    def __init__(self, context: ssl.SSLContext, sock: socket.socket, host: str) -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=host)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(self.outgoing.read())
                self.incoming.write(_receive(sock)[0])
        sock.sendall(self.outgoing.read())  # the client's Finished (TLS 1.3)

    def seal(self, plain: bytes) -> bytes:
        self.tls.write(plain)
        return self.outgoing.read()

    def open(self, sealed: bytes) -> bytes:
        """The plaintext of ``sealed`` and what came before it, as far as whole records go (a
        session ticket yields none)."""
        self.incoming.write(sealed)
        plain = b""
        while True:
            try:
                chunk = self.tls.read(65536)
            except ssl.SSLWantReadError:
                return plain
            except ssl.SSLZeroReturnError:
                raise _Closed from None
            if not chunk:
                raise _Closed
            plain += chunk


def _answer_length(buffer: bytes) -> int:
    """The whole answer's length in bytes, from its head; a status other than 200 ends the probe."""
    head, _, _ = buffer.partition(b"\r\n\r\n")
    status, *fields = head.split(b"\r\n")
    if not status.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"probe: the extender answered {status.decode(errors='replace')!r}")
    for field in fields:
        name, _, value = field.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    raise SystemExit("probe: the answer has no Content-Length")


def client_tls(ca: str, cert: str, key: str) -> ssl.SSLContext:
    """The probe's TLS: the server checked against ``ca``, the client certificate presented."""
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(cert, key)
    return context


def main(url: str, interval_s: float, tls: ssl.SSLContext | None = None) -> dict[str, list[float]]:
    payload = sys.stdin.buffer.readline().strip()
    probe = Probe(url, payload, tls)
    wall: list[float] = []
    arrival: list[float] = []
    while True:
        took, arrived = probe.sample()
        wall.append(took)
        arrival.append(arrived)
        # The bench closes stdin to stop us: readable with nothing to read.
        ready, _, _ = select.select([sys.stdin], [], [], interval_s)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            return {"wall": wall, "arrival": arrival}


if __name__ == "__main__":
    if len(sys.argv) not in (3, 6):
        raise SystemExit("usage: _filter_probe.py URL INTERVAL_S [CA CERT KEY]")
    tls = client_tls(*sys.argv[3:]) if sys.argv[3:] else None
    print(json.dumps(main(sys.argv[1], float(sys.argv[2]), tls)))
