"""The node agents' small HTTP server: ``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for
the kubelet's probes (the device plugin and the monitor; the webhook and the extender serve these
from their own apps). Any pod can reach it, so it runs under ``http_limits`` as every server of ours."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hamipy.telemetry.http_limits import BoundedServer, HttpLimits, start_bounded_site

__all__ = ["PROBE_LIMITS", "ProbeServer", "start_probe_server"]

PROBE_LIMITS: Final = HttpLimits(max_connections=64)
"""The defaults but the cap: its callers (the kubelet, Prometheus) hold a few connections at most."""


class ProbeServer:
    """A started server: ``port`` is the bound port (useful with port 0); ``close()`` stops it."""

    def __init__(self, server: BoundedServer) -> None:
        self.server = server
        self.runner = server.runner
        self.port = server.port

    async def close(self) -> None:
        await self.server.close()


async def start_probe_server(
    *,
    host: str,
    port: int,
    render: Callable[[], Awaitable[bytes]],
    not_ready: Callable[[], str | None],
    limits: HttpLimits = PROBE_LIMITS,
) -> ProbeServer:
    """Serve ``await render()`` on ``/metrics``, ``ok`` on ``/healthz``, and on ``/readyz`` ``ok`` or
    HTTP 503 with the reason ``not_ready()`` gives. ``render`` chooses where the work runs: a scrape
    that reads files runs in a thread (``functools.partial(asyncio.to_thread, ...)``); one that reads
    state the event loop owns runs on the loop, in steps."""

    async def metrics(request: web.Request) -> web.Response:
        body = await render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(request: web.Request) -> web.Response:
        reason = not_ready()
        return web.Response(text="ok") if reason is None else web.Response(status=503, text=reason)

    app = web.Application(client_max_size=1024)  # GETs only: no body worth reading
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return ProbeServer(await start_bounded_site(app, host=host, port=port, limits=limits))
