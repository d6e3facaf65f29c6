"""The node agents' probe server: metrics rendered on demand, liveness, readiness with a reason."""

from __future__ import annotations

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST

from hamipy.telemetry.probes import start_probe_server


async def test_metrics_health_and_readiness_with_its_reason() -> None:
    reason: list[str | None] = ["pods not listed yet"]
    scrapes: list[int] = []

    def render() -> bytes:
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
