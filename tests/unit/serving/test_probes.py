"""The node agents' probe server: metrics rendered on demand, liveness, readiness with a reason."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST

from hamipy.serving.http_limits import HttpLimits
from hamipy.serving.probes import start_probe_server


async def test_metrics_health_and_readiness_with_its_reason() -> None:
    reason: list[str | None] = ["pods not listed yet"]
    scrapes: list[int] = []

    async def render() -> bytes:
        scrapes.append(1)
        return b"up 1\n"

    server = await start_probe_server(host="127.0.0.1", port=0, render=render, not_ready=lambda: reason[0])
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"{base}/healthz") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
            async with session.get(f"{base}/readyz") as resp:
                assert (resp.status, await resp.text()) == (503, "pods not listed yet")
            reason[0] = None
            async with session.get(f"{base}/readyz") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
            async with session.get(f"{base}/metrics") as resp:
                assert await resp.read() == b"up 1\n"
                assert resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
    finally:
        await server.close()
    assert server.port != 0
    assert len(scrapes) == 1


async def test_metrics_rendered_in_chunks_are_served_whole_with_their_length() -> None:
    # Big enough that the socket's buffers fill and the writes wait for the reader.
    chunks = [b"# HELP a A\n", b"a 1\n" * 1_000_000, b"", b"b 2\n" * 500_000]

    async def render() -> list[bytes]:
        return chunks

    server = await start_probe_server(host="127.0.0.1", port=0, render=render, not_ready=lambda: None)
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.get(f"http://127.0.0.1:{server.port}/metrics") as resp,
        ):
            body = await resp.read()
            assert resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
            assert int(resp.headers["Content-Length"]) == len(body)
    finally:
        await server.close()
    assert body == b"".join(chunks)


async def test_a_head_of_chunked_metrics_gets_the_headers_alone_and_the_connection_stays_usable() -> None:
    async def render() -> list[bytes]:
        return [b"a 1\n", b"b 2\n"]

    server = await start_probe_server(host="127.0.0.1", port=0, render=render, not_ready=lambda: None)
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        connector = aiohttp.TCPConnector(limit=1)  # one connection: the GET reuses the HEAD's
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=10)
        ) as session:
            async with session.head(url) as resp:
                assert (resp.status, resp.headers["Content-Length"], await resp.read()) == (200, "8", b"")
            async with session.get(url) as resp:
                assert (resp.status, await resp.read()) == (200, b"a 1\nb 2\n")
    finally:
        await server.close()


async def test_a_client_that_never_sends_its_request_is_cut_and_probes_still_answer() -> None:
    limits = HttpLimits(header_timeout_s=0.3, body_timeout_s=0.3, keepalive_timeout_s=1, max_connections=2)
    server = await start_probe_server(
        host="127.0.0.1", port=0, render=_nothing, not_ready=lambda: None, limits=limits
    )
    try:
        silent = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(f"http://127.0.0.1:{server.port}/healthz") as resp,
        ):
            assert (resp.status, await resp.text()) == (200, "ok")
        for reader, writer in silent:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # hung up on, without an answer
            writer.close()
    finally:
        await server.close()


async def _nothing() -> bytes:
    return b""
