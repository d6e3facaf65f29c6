"""The HTTP server kube-scheduler calls, and the background work that keeps the model current.

Routes: ``POST /filter``, ``/prioritize``, ``/bind`` (extender JSON, Go field names);
``GET /healthz`` (the process serves), ``/readyz`` (both Nodes and Pods listed, so decisions see
the whole cluster), ``/metrics`` (Prometheus). A body that is not JSON, not the expected argument,
or over ``max_body_bytes`` gets HTTP 400 with the reason; kube-scheduler counts that as an extender
error for the pod and retries it, and the server keeps serving.

``ExtenderServer`` owns one extender: model, scheduler, binder, event sink, the Node and Pod
watchers and the handshake loop, all started in the app's ``cleanup_ctx`` as named tasks and
cancelled on shutdown (SIGTERM: readiness fails first, in-flight requests drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Coroutine
from types import TracebackType
from typing import Any, Final, Self

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hamipy.extender.binding import Binder
from hamipy.extender.events import EventSink
from hamipy.extender.kube import KubeApi
from hamipy.extender.model import ClusterModel
from hamipy.extender.scheduler import BadRequest, Scheduler
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.extender.watching import Watcher, stamp_handshakes
from hamipy.protocol.config import Config

__all__ = ["SCHEDULER", "STOPPING", "ExtenderServer", "make_app"]

SCHEDULER: Final = web.AppKey("scheduler", Scheduler)
STOPPING: Final = web.AppKey("stopping", asyncio.Event)
MAX_BODY: Final = web.AppKey("max_body_bytes", int)
_JSON: Final = "application/json"


async def _json_body(request: web.Request) -> Any:
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"request body larger than {request.app[MAX_BODY]} bytes") from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None


def _bad(request: web.Request, exc: BadRequest) -> web.Response:
    request.app[SCHEDULER].telemetry.logger.warning(
        "bad request", path=request.path, remote=request.remote, error=str(exc)
    )
    request.app[SCHEDULER].telemetry.metrics.decisions.labels(
        verb=request.path.strip("/"), result="bad-request", reason="BadRequest"
    ).inc()
    return web.json_response({"Error": str(exc)}, status=400)


async def _filter(request: web.Request) -> web.Response:
    try:
        args = await _json_body(request)
        result = request.app[SCHEDULER].filter(args)
    except BadRequest as exc:
        return _bad(request, exc)
    return web.Response(body=json.dumps(result, separators=(",", ":")), content_type=_JSON)


async def _prioritize(request: web.Request) -> web.Response:
    try:
        args = await _json_body(request)
        result = request.app[SCHEDULER].prioritize(args)
    except BadRequest as exc:
        return _bad(request, exc)
    return web.Response(body=json.dumps(result, separators=(",", ":")), content_type=_JSON)


async def _bind(request: web.Request) -> web.Response:
    try:
        args = await _json_body(request)
        result = await request.app[SCHEDULER].bind(args)
    except BadRequest as exc:
        return _bad(request, exc)
    return web.json_response(result)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _readyz(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER]
    if request.app[STOPPING].is_set():
        return web.Response(status=503, text="stopping")
    if not scheduler.model.synced:
        return web.Response(status=503, text="model not synced yet (listing nodes and pods)")
    return web.Response(text="ok")


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[SCHEDULER].telemetry.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(
    scheduler: Scheduler, *, max_body_bytes: int, stopping: asyncio.Event | None = None
) -> web.Application:
    """The routes over one ``Scheduler`` (no background work: ``ExtenderServer`` adds that)."""
    app = web.Application(client_max_size=max_body_bytes)
    app[SCHEDULER] = scheduler
    app[MAX_BODY] = max_body_bytes
    app[STOPPING] = stopping if stopping is not None else asyncio.Event()
    app.router.add_post("/filter", _filter)
    app.router.add_post("/prioritize", _prioritize)
    app.router.add_post("/bind", _bind)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app


class ExtenderServer:
    """One running extender (``async with ExtenderServer(...) as server``); ``port`` once started.

    ``api`` None runs without the cluster (no watch, no bind): for benchmarks and unit tests that
    feed the model themselves.
    """

    def __init__(
        self,
        *,
        config: Config,
        settings: ExtenderSettings,
        telemetry: Telemetry,
        api: KubeApi | None,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        self.config = config
        self.settings = settings
        self.telemetry = telemetry
        self.api = api
        self.host = host
        self.requested_port = port
        self.ssl_context = ssl_context
        self.shutdown_timeout_s = shutdown_timeout_s
        self.model = ClusterModel(count_resource=config.nvidia.resource_count_name)
        telemetry.metrics.attach(self.model)
        self.events = EventSink(
            api, telemetry, size=settings.event_queue_size, timeout_s=settings.api_timeout_s
        )
        binder = (
            Binder(api=api, model=self.model, config=config, settings=settings, telemetry=telemetry)
            if api is not None
            else None
        )
        self.scheduler = Scheduler(
            model=self.model,
            config=config,
            settings=settings,
            telemetry=telemetry,
            events=self.events,
            binder=binder,
        )
        self.stopping = asyncio.Event()
        self.synced = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _on_change(self) -> None:
        if self.model.synced:
            self.synced.set()

    async def _supervised(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self.telemetry.logger.exception("background task failed", task=name)
            raise

    async def _background(self, app: web.Application) -> AsyncIterator[None]:
        jobs: list[tuple[str, Coroutine[Any, Any, None]]] = [("extender-events", self.events.run())]
        if self.api is not None:
            for resource in ("nodes", "pods"):
                watcher = Watcher(
                    resource,
                    api=self.api,
                    model=self.model,
                    settings=self.settings,
                    telemetry=self.telemetry,
                    events=self.events,
                    on_change=self._on_change,
                )
                jobs.append((f"extender-watch-{resource}", watcher.run()))
            if self.settings.handshake_interval_s > 0:
                jobs.append(
                    (
                        "extender-handshake",
                        stamp_handshakes(
                            api=self.api, model=self.model, settings=self.settings, telemetry=self.telemetry
                        ),
                    )
                )
        self._tasks = [asyncio.create_task(self._supervised(n, c), name=n) for n, c in jobs]
        yield
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await asyncio.to_thread(self.telemetry.shutdown)

    async def start(self) -> None:
        app = make_app(self.scheduler, max_body_bytes=self.settings.max_body_bytes, stopping=self.stopping)
        app.cleanup_ctx.append(self._background)
        runner = web.AppRunner(app, shutdown_timeout=self.shutdown_timeout_s, access_log=None)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, self.host, self.requested_port, ssl_context=self.ssl_context)
        await site.start()
        self.port = int(runner.addresses[-1][1])
        self.telemetry.logger.info(
            "extender serving",
            host=self.host,
            port=self.port,
            tls=self.ssl_context is not None,
            cooperative=self.settings.cooperative,
            release_lock_after_bind=self.settings.release_lock_after_bind,
        )

    async def wait_synced(self, timeout_s: float = 30.0) -> None:
        """Return once the model has listed Nodes and Pods."""
        async with asyncio.timeout(timeout_s):
            await self.synced.wait()

    async def stop(self) -> None:
        """Fail readiness, drain in-flight requests, stop the background tasks."""
        self.stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.telemetry.logger.info("extender stopped")

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
