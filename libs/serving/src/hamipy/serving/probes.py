"""``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for the kubelet's probes: the node
agents' small HTTP server (the device plugin's and the monitor's), and the same routes on the
webhook's apps (the extender's decision port has them in its own route table). Any pod can reach
them, so they run under ``http_limits`` as every server of ours."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hamipy.serving.http_limits import BoundedServer, HttpLimits, start_bounded_site

__all__ = ["PROBE_LIMITS", "add_probe_routes", "start_probe_server", "streamed_response"]

PROBE_LIMITS: Final = HttpLimits(max_connections=64)
"""The defaults but the cap: its callers (the kubelet, Prometheus) hold a few connections at most."""
_METRICS_HEADERS: Final = {"Content-Type": CONTENT_TYPE_LATEST}


async def streamed_response(
    request: web.Request,
    body: bytes | Sequence[bytes],
    *,
    status: int = 200,
    headers: Mapping[str, str],
) -> web.StreamResponse:
    """An answer of ``body``, or of its chunks written one by one. A scrape of a large model is
    megabytes (10 MB at 1,000 nodes): joined, it costs the event loop a copy of all of it in one
    step; written in chunks, each is handed to the socket (or its buffer) in a step of
    its own, and a full buffer makes the write wait without holding the loop."""
    if isinstance(body, bytes):
        return web.Response(status=status, body=body, headers=headers)
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = sum(len(chunk) for chunk in body)
    await response.prepare(request)
    if request.method != "HEAD":  # a StreamResponse would write the body after a HEAD's headers
        for chunk in body:
            await response.write(chunk)
    await response.write_eof()
    return response


def add_probe_routes(
    app: web.Application,
    *,
    render: Callable[[], Awaitable[bytes | Sequence[bytes]]],
    not_ready: Callable[[], str | None],
) -> None:
    """Serve ``await render()`` (the body, or its chunks) on ``/metrics``, ``ok`` on ``/healthz``,
    and on ``/readyz`` ``ok`` or HTTP 503 with the reason ``not_ready()`` gives. ``render`` chooses
    where the work runs: a scrape that reads files runs in a thread
    (``functools.partial(asyncio.to_thread, ...)``); one that reads state the event loop owns runs
    on the loop, in steps."""

    async def metrics(request: web.Request) -> web.StreamResponse:
        return await streamed_response(request, await render(), headers=_METRICS_HEADERS)

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(request: web.Request) -> web.Response:
        reason = not_ready()
        return web.Response(text="ok") if reason is None else web.Response(status=503, text=reason)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)


async def start_probe_server(
    *,
    host: str,
    port: int,
    render: Callable[[], Awaitable[bytes | Sequence[bytes]]],
    not_ready: Callable[[], str | None],
    limits: HttpLimits = PROBE_LIMITS,
) -> BoundedServer:
    """A server of ``add_probe_routes`` alone."""
    app = web.Application(client_max_size=1024)  # GETs only: no body worth reading
    add_probe_routes(app, render=render, not_ready=not_ready)
    return await start_bounded_site(app, host=host, port=port, limits=limits)
