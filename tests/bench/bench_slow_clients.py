"""Benchmark: the webhook server's memory under 1,500 slow clients, with and without the limits.

Run as a script: ``.venv/bin/python tests/bench/bench_slow_clients.py [--clients 1500]``. For each
mode a fresh process serves the webhook over TLS on 127.0.0.1 (plus its plain probe port):
``bounded`` is ``WebhookServer`` as shipped (``hamipy.telemetry.http_limits`` defaults: 10 s header
timeout, 256 connections); ``unbounded`` serves the same app on aiohttp's own ``TCPSite``, as the
webhook did before. This process then opens the clients (half never send a TLS ClientHello, half
finish the handshake and trickle a request header a byte a second) and reads the server process's
RSS from ``/proc`` before, while they are held, and after the header timeout; ``/healthz`` is
timed on both ports during the attack. Target: the bounded server stays under the chart's 256 Mi
memory limit and keeps answering.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import multiprocessing
import ssl
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))

from _results import record

from hamipy.webhook.admitting import Admitter
from hamipy.webhook.certs import generate_certificates, write_files
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.server import CertificateStore, ServerSettings, WebhookServer, make_app
from hamipy.webhook.telemetry import Telemetry

MEMORY_LIMIT_MIB = 256
HEADER_TIMEOUT_S = 10.0


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmRSS")


async def _serve(mode: str, directory: Path, pipe: Connection) -> None:
    cert, key, _ = write_files(
        generate_certificates(dns_names=["localhost"], ip_addresses=["127.0.0.1"]), directory
    )
    admitter = Admitter(MutationSettings(), Telemetry.create(stream=io.StringIO()))
    settings = ServerSettings(cert_file=cert, key_file=key, host="127.0.0.1", port=0, metrics_port=0)
    if mode == "bounded":
        async with WebhookServer(settings, admitter) as server:
            pipe.send((server.port, server.metrics_port, (directory / "ca.crt").read_bytes()))
            await asyncio.to_thread(_wait_for_parent, pipe)
        return
    # The webhook as it was: aiohttp's TCPSite, asyncio's TLS, no limits but aiohttp's keep-alive.
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


def _server_main(mode: str, pipe: Connection) -> None:
    with tempfile.TemporaryDirectory() as directory:
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


async def _healthz_ms(url: str, ca: ssl.SSLContext) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        connector = aiohttp.TCPConnector(ssl=ca, force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(url) as response,
        ):
            status: int | str = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        status = type(exc).__name__
    return {"status": status, "ms": round((time.perf_counter() - started) * 1000, 1)}


async def _attack(mode: str, clients: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_server_main, args=(mode, child), daemon=True)
    process.start()
    try:
        port, probe_port, ca_pem = await asyncio.to_thread(parent.recv)
        assert process.pid is not None
        ca = ssl.create_default_context(cadata=ca_pem.decode())
        probe_scheme = "https" if probe_port == port else "http"
        before = _rss_mib(process.pid)
        held: list[asyncio.StreamWriter] = []
        stop = asyncio.Event()
        started = time.monotonic()
        tasks = [asyncio.create_task(_silent(port, held)) for _ in range(clients // 2)]
        tasks += [asyncio.create_task(_trickler(port, ca, held, stop)) for _ in range(clients - clients // 2)]
        await asyncio.sleep(5)  # the clients connect and handshake (paced by the server's accept)
        during = _rss_mib(process.pid)
        probe = await _healthz_ms(f"{probe_scheme}://127.0.0.1:{probe_port}/healthz", ca)
        tls_probe = await _healthz_ms(f"https://127.0.0.1:{port}/healthz", ca)
        await asyncio.sleep(max(0.0, HEADER_TIMEOUT_S + 3 - (time.monotonic() - started)))
        after_timeout = _rss_mib(process.pid)
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
    finally:
        parent.close()
        process.join(10)
        if process.is_alive():
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1500)
    parser.add_argument(
        "--modes", nargs="+", default=["bounded", "unbounded"], choices=["bounded", "unbounded"]
    )
    args = parser.parse_args()
    figures: dict[str, Any] = {"clients": args.clients, "memory_limit_mib": MEMORY_LIMIT_MIB}
    for mode in args.modes:
        figures[mode] = asyncio.run(_attack(mode, args.clients))
    record("slow_clients", figures)


if __name__ == "__main__":
    main()
