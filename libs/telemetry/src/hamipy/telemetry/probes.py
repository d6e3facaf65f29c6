"""The node agents' small HTTP server: ``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for
the kubelet's probes (the device plugin and the monitor; the webhook and the extender serve these
from their own apps)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["ProbeServer", "start_probe_server"]


class ProbeServer:
    """A started server: ``port`` is the bound port (useful with port 0); ``close()`` stops it."""

    def __init__(self, runner: web.AppRunner, port: int) -> None:
        self.runner = runner
        self.port = port

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_probe_server(
    *, host: str, port: int, render: Callable[[], bytes], not_ready: Callable[[], str | None]
) -> ProbeServer:
    """Serve ``render()`` (run in a thread: a scrape may read files) on ``/metrics``, ``ok`` on
    ``/healthz``, and on ``/readyz`` ``ok`` or HTTP 503 with the reason ``not_ready()`` gives."""

    async def metrics(request: web.Request) -> web.Response:
        body = await asyncio.to_thread(render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(request: web.Request) -> web.Response:
        reason = not_ready()
        return web.Response(text="ok") if reason is None else web.Response(status=503, text=reason)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    bound = port
    with contextlib.suppress(IndexError, TypeError):
        bound = int(runner.addresses[0][1])
    return ProbeServer(runner, bound)
