"""Benchmark: the webhook server under slow clients: its memory, and whether its probes and
admissions are answered meanwhile.

Run as a script: ``.venv/bin/python tests/bench/bench_slow_clients.py [--attack headers|bodies]
[--clients N] [--seconds S]``. For each mode a fresh process serves the webhook over TLS on
127.0.0.1 (plus its plain probe port): ``bounded`` is ``WebhookServer`` as shipped
(``hamipy.serving.http_limits`` defaults: 10 s header and body timeouts, 256 connections, 512
queued); ``unbounded`` serves the same app on aiohttp's own ``TCPSite``, with no limits but
aiohttp's keep-alive. This process then attacks it:

- ``headers`` (default 1,500 clients): half never send a TLS ClientHello, half finish the handshake
  and trickle a request head a byte a second. RSS is read before, while they are held, and after
  the header timeout; ``/healthz`` is timed once on each port during the attack.
- ``bodies`` (default 600 clients, ``--seconds`` 30): from a process of their own and another
  source address (``--source``, as another pod's), each client finishes the handshake, sends an
  AdmissionReview's head and then its body a byte a second, and opens a new connection
  ``--reconnect`` seconds (1) after the server closes one. Meanwhile this process counts the
  kubelet's probe (``/healthz`` on the probe port, every 0.5 s, 1 s timeout: the kubelet's
  default), the same on the TLS port, and an AdmissionReview of a GPU pod every second (10 s
  timeout: the chart's ``timeoutSeconds``) answered or not, and samples RSS every second. At the
  end every client leaves at once (killed pods), and the server's output is searched for
  tracebacks and its "client left mid-request" lines.

Targets: the bounded server stays under the chart's 256 Mi memory limit, answers every probe and
every admission, and logs no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import ssl
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))

from _results import record
from bench_webhook import review_body, typical_gpu_pod

from hamipy.webhook.admitting import Admitter
from hamipy.webhook.certs import generate_certificates, write_files
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.server import CertificateStore, ServerSettings, WebhookServer, make_app
from hamipy.webhook.telemetry import Telemetry

MEMORY_LIMIT_MIB = 256
HEADER_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 1.0
"""The kubelet's default ``timeoutSeconds``: the chart sets none."""
ADMISSION_TIMEOUT_S = 10.0
"""The chart's ``webhook.timeoutSeconds``."""
REVIEW = review_body(typical_gpu_pod())
"""What the slow clients send, slowly, and the admissions promptly."""
SLOW_HEAD = (
    b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(REVIEW)}\r\n\r\n".encode()
)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmRSS")


async def _serve(mode: str, directory: Path, pipe: Connection) -> None:
    cert, key, _ = write_files(
        generate_certificates(dns_names=["localhost"], ip_addresses=["127.0.0.1"]), directory
    )
    with (directory / "log.jsonl").open("w", buffering=1) as log:
        admitter = Admitter(MutationSettings(), Telemetry.create(stream=log))
        settings = ServerSettings(cert_file=cert, key_file=key, host="127.0.0.1", port=0, metrics_port=0)
        if mode == "bounded":
            async with WebhookServer(settings, admitter) as server:
                pipe.send((server.port, server.metrics_port, (directory / "ca.crt").read_bytes()))
                await asyncio.to_thread(_wait_for_parent, pipe)
            return
        # aiohttp's own TCPSite and asyncio's TLS: no limits but aiohttp's keep-alive.
        runner = web.AppRunner(make_app(admitter), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=CertificateStore(cert, key).ssl_context)
        await site.start()
        port = int(runner.addresses[-1][1])
        pipe.send((port, port, (directory / "ca.crt").read_bytes()))
        await asyncio.to_thread(_wait_for_parent, pipe)
        await runner.cleanup()


def _wait_for_parent(pipe: Connection) -> None:
    with contextlib.suppress(EOFError):
        pipe.recv()


def _server_main(mode: str, directory: str, pipe: Connection) -> None:
    # aiohttp and asyncio log through the standard library; without a handler, to stderr.
    with (Path(directory) / "stderr.txt").open("w", buffering=1) as stderr:
        sys.stderr = stderr
        asyncio.run(_serve(mode, Path(directory), pipe))


async def _silent(port: int, held: list[asyncio.StreamWriter]) -> None:
    with contextlib.suppress(OSError, TimeoutError):
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        held.append(writer)


async def _trickler(
    port: int, ca: ssl.SSLContext, held: list[asyncio.StreamWriter], stop: asyncio.Event
) -> None:
    with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
        _, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=ca, server_hostname="127.0.0.1"), 30
        )
        held.append(writer)
        for byte in b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n":
            if stop.is_set():
                return
            writer.write(bytes([byte]))
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


async def _slow_body(
    attack: _BodyAttack, ca: ssl.SSLContext, stop: asyncio.Event, counts: Counter[str]
) -> None:
    """Send an AdmissionReview's body a byte a second; when the server closes the connection (or
    does not take it), open a new one after ``attack.reconnect_s``."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    "127.0.0.1",
                    attack.port,
                    ssl=ca,
                    server_hostname="127.0.0.1",
                    local_addr=(attack.source, 0),
                ),
                10,
            )
        except (OSError, TimeoutError, ssl.SSLError):
            counts["connect_failed"] += 1
        else:
            counts["connections"] += 1
            try:
                writer.write(SLOW_HEAD)
                for byte in REVIEW:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        if not await asyncio.wait_for(reader.read(65536), 1.0):
                            counts["closed_by_server"] += 1
                            break
                    if stop.is_set():
                        break
            except (OSError, ssl.SSLError):
                counts["closed_by_server"] += 1
            finally:
                writer.transport.abort()  # gone at once, as a killed pod's connection
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), attack.reconnect_s)


@dataclasses.dataclass(frozen=True)
class _BodyAttack:
    port: int
    ca_pem: bytes
    clients: int
    reconnect_s: float
    source: str
    """The attackers' source address (another pod's, not the probes' and the API server's)."""


async def _attack_bodies(attack: _BodyAttack, pipe: Connection) -> None:
    ca = ssl.create_default_context(cadata=attack.ca_pem.decode())
    counts: Counter[str] = Counter()
    stop = asyncio.Event()
    attackers = [asyncio.create_task(_slow_body(attack, ca, stop, counts)) for _ in range(attack.clients)]
    await asyncio.to_thread(_wait_for_parent, pipe)
    stop.set()
    await asyncio.gather(*attackers)
    pipe.send(dict(counts))


def _attackers_main(attack: _BodyAttack, pipe: Connection) -> None:
    asyncio.run(_attack_bodies(attack, pipe))


async def _timed(call: Callable[[], Awaitable[int]], timeout_s: float) -> tuple[int | str, float]:
    started = time.perf_counter()
    try:
        status: int | str = await asyncio.wait_for(call(), timeout_s)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        status = type(exc).__name__
    return status, time.perf_counter() - started


def _getter(url: str, ca: ssl.SSLContext) -> Callable[[], Awaitable[int]]:
    async def get() -> int:
        connector = aiohttp.TCPConnector(ssl=ca, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session, session.get(url) as response:
            await response.read()
            return response.status

    return get


def _admitter(url: str, ca: ssl.SSLContext) -> Callable[[], Awaitable[int]]:
    async def admit() -> int:
        connector = aiohttp.TCPConnector(ssl=ca, force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.post(url, data=REVIEW, headers={"Content-Type": "application/json"}) as response,
        ):
            answer = await response.json()
            return response.status if answer["response"]["allowed"] else 403

    return admit


async def _healthz_ms(url: str, ca: ssl.SSLContext) -> dict[str, Any]:
    status, elapsed = await _timed(_getter(url, ca), 10)
    return {"status": status, "ms": round(elapsed * 1000, 1)}


class _Server:
    """The server process of one mode: ports, CA, pid and its log directory."""

    def __init__(self, mode: str, directory: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self.parent, child = context.Pipe()
        self.process = context.Process(target=_server_main, args=(mode, str(directory), child), daemon=True)
        self.directory = directory

    async def __aenter__(self) -> _Server:
        self.process.start()
        self.port, self.probe_port, self.ca_pem = await asyncio.to_thread(self.parent.recv)
        assert self.process.pid is not None
        self.pid = self.process.pid
        self.ca = ssl.create_default_context(cadata=self.ca_pem.decode())
        self.probe_scheme = "https" if self.probe_port == self.port else "http"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.parent.close()
        await asyncio.to_thread(self.process.join, 30)
        if self.process.is_alive():
            self.process.kill()


async def _headers_attack(server: _Server, clients: int) -> dict[str, Any]:
    before = _rss_mib(server.pid)
    held: list[asyncio.StreamWriter] = []
    stop = asyncio.Event()
    started = time.monotonic()
    port = server.port
    tasks = [asyncio.create_task(_silent(port, held)) for _ in range(clients // 2)]
    tasks += [
        asyncio.create_task(_trickler(port, server.ca, held, stop)) for _ in range(clients - clients // 2)
    ]
    await asyncio.sleep(5)  # the clients connect and handshake (paced by the server's accept)
    during = _rss_mib(server.pid)
    probe = await _healthz_ms(f"{server.probe_scheme}://127.0.0.1:{server.probe_port}/healthz", server.ca)
    tls_probe = await _healthz_ms(f"https://127.0.0.1:{port}/healthz", server.ca)
    await asyncio.sleep(max(0.0, HEADER_TIMEOUT_S + 3 - (time.monotonic() - started)))
    after_timeout = _rss_mib(server.pid)
    peak = max(during, after_timeout)
    stop.set()
    for writer in held:
        writer.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "rss_before_mib": before,
        "rss_with_clients_mib": during,
        "rss_after_header_timeout_mib": after_timeout,
        "healthz_probe_port": probe,
        "healthz_tls_port": tls_probe,
        "under_memory_limit": peak < MEMORY_LIMIT_MIB,
    }


def _summary(results: list[tuple[int | str, float]], ok: int) -> dict[str, Any]:
    answered = [elapsed for status, elapsed in results if status == ok]
    failures = Counter(str(status) for status, _ in results if status != ok)
    return {
        "answered": f"{len(answered)}/{len(results)}",
        "failed": dict(failures),
        "p50_ms": round(statistics.median(answered) * 1000, 1) if answered else None,
        "max_ms": round(max(answered) * 1000, 1) if answered else None,
    }


async def _every(
    interval_s: float, stop: asyncio.Event, call: Callable[[], Coroutine[Any, Any, None]]
) -> None:
    """Start ``call`` every ``interval_s`` (each on its own: a slow one delays no other) until ``stop``."""
    running: list[asyncio.Task[Any]] = []
    while not stop.is_set():
        running.append(asyncio.create_task(call()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    await asyncio.gather(*running)


async def _closed_counts(server: _Server) -> dict[str, float]:
    """The server's ``hamipy_webhook_http_connections_closed_total`` of its TLS port, by reason."""
    connector = aiohttp.TCPConnector(ssl=server.ca, force_close=True)
    url = f"{server.probe_scheme}://127.0.0.1:{server.probe_port}/metrics"
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(url) as response,
    ):
        text = await response.text()
    prefix = 'hamipy_webhook_http_connections_closed_total{reason="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and 'server="api"' in line
    }


async def _bodies_attack(server: _Server, attack: _BodyAttack, seconds: float) -> dict[str, Any]:
    before = _rss_mib(server.pid)
    stop = asyncio.Event()
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    attackers = context.Process(target=_attackers_main, args=(attack, child), daemon=True)
    attackers.start()
    probes: list[tuple[int | str, float]] = []
    tls_probes: list[tuple[int | str, float]] = []
    admissions: list[tuple[int | str, float]] = []
    rss: list[float] = []

    def recorder(
        into: list[tuple[int | str, float]], call: Callable[[], Awaitable[int]], timeout_s: float
    ) -> Callable[[], Coroutine[Any, Any, None]]:
        async def run() -> None:
            into.append(await _timed(call, timeout_s))

        return run

    async def sample_rss() -> None:
        rss.append(_rss_mib(server.pid))

    probe_url = f"{server.probe_scheme}://127.0.0.1:{server.probe_port}/healthz"
    watchers = [
        _every(0.5, stop, recorder(probes, _getter(probe_url, server.ca), PROBE_TIMEOUT_S)),
        _every(
            0.5,
            stop,
            recorder(
                tls_probes, _getter(f"https://127.0.0.1:{server.port}/healthz", server.ca), PROBE_TIMEOUT_S
            ),
        ),
        _every(
            1.0,
            stop,
            recorder(
                admissions,
                _admitter(f"https://127.0.0.1:{server.port}/webhook", server.ca),
                ADMISSION_TIMEOUT_S,
            ),
        ),
        _every(1.0, stop, sample_rss),
    ]
    watching = asyncio.gather(*watchers)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(watching), seconds)
    stop.set()
    parent.send("stop")  # every client leaves at once, mid-body
    counts: dict[str, int] = await asyncio.to_thread(parent.recv)
    await asyncio.to_thread(attackers.join, 30)
    await watching
    closed = await _closed_counts(server) if server.probe_port != server.port else {}
    return {
        "seconds": seconds,
        "rss_before_mib": before,
        "rss_peak_mib": max(rss),
        "under_memory_limit": max(rss) < MEMORY_LIMIT_MIB,
        "reconnect_s": attack.reconnect_s,
        "slow_connections_opened": counts.get("connections", 0),
        "slow_connections_closed_by_server": counts.get("closed_by_server", 0),
        "slow_connects_failed": counts.get("connect_failed", 0),
        "probes_probe_port": _summary(probes, 200),
        "probes_tls_port": _summary(tls_probes, 200),
        "admissions": _summary(admissions, 200),
        "server_closed": closed,
    }


def _log_figures(directory: Path) -> dict[str, Any]:
    """Tracebacks in the server's output (aiohttp's and asyncio's, through the standard library to
    stderr; ours in the JSON log), each named by its exception, and our "client left" lines."""
    stderr = (directory / "stderr.txt").read_text()
    lines = [json.loads(line) for line in (directory / "log.jsonl").read_text().splitlines() if line]
    kinds: Counter[str] = Counter()
    for block in stderr.split("Traceback (most recent call last):")[1:]:
        kinds[next((line for line in block.splitlines() if line and not line[0].isspace()), "?")[:120]] += 1
    kinds.update(str(line["exception"])[:120] for line in lines if "exception" in line)
    return {
        "tracebacks": sum(kinds.values()),
        "traceback_kinds": dict(kinds),
        "client_left_lines": sum(1 for line in lines if line.get("event") == "client left mid-request"),
    }


async def _attack(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        async with _Server(mode, directory) as server:
            if args.attack == "headers":
                figures = await _headers_attack(server, args.clients)
            else:
                attack = _BodyAttack(server.port, server.ca_pem, args.clients, args.reconnect, args.source)
                figures = await _bodies_attack(server, attack, args.seconds)
        return figures | _log_figures(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attack", choices=["headers", "bodies"], default="headers")
    parser.add_argument("--clients", type=int, default=None, help="1,500 for headers, 600 for bodies")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the bodies attack")
    parser.add_argument(
        "--reconnect", type=float, default=1.0, help="seconds a bodies client waits before it reconnects"
    )
    parser.add_argument(
        "--source", default="127.0.0.2", help="the bodies clients' source address (a loopback one)"
    )
    parser.add_argument(
        "--modes", nargs="+", default=["bounded", "unbounded"], choices=["bounded", "unbounded"]
    )
    args = parser.parse_args()
    args.clients = args.clients or (1500 if args.attack == "headers" else 600)
    figures: dict[str, Any] = {
        "attack": args.attack,
        "clients": args.clients,
        "memory_limit_mib": MEMORY_LIMIT_MIB,
    }
    for mode in args.modes:
        figures[mode] = asyncio.run(_attack(mode, args))
    record("slow_clients" if args.attack == "headers" else "slow_bodies", figures)


if __name__ == "__main__":
    main()
