"""The HTTP server kube-scheduler calls, and the background work that keeps the model current.

Routes: ``POST /filter``, ``/prioritize``, ``/bind``, ``/preempt`` (extender JSON, Go field names);
``GET /healthz`` (the process serves), ``/readyz`` (both Nodes and Pods listed, so decisions see
the whole cluster, and no background task dead), ``/metrics`` (Prometheus). A body that is not
JSON, nested deeper than ``json_bodies.MAX_DEPTH``, not the expected argument (a field the
decisions read with the wrong JSON type: ``_ARGS``, ``_BINDING_ARGS``), or over ``max_body_bytes``
gets HTTP 400 with the reason; kube-scheduler counts that as an extender error for the pod and
retries it, and the server keeps serving. Any pod can reach this server, so it runs under
``hamipy.telemetry.http_limits`` (header, body and keep-alive timeouts, a connection cap).

With ``metrics_port`` the same ``/healthz``, ``/readyz`` and ``/metrics`` are also served over plain
HTTP on a port of their own (``hamipy.telemetry.probes``), so that the decision port can demand
kube-scheduler's client certificate (``--tls-client-ca-file``) while the kubelet's probes and
Prometheus need none (docs/security.md).

``ExtenderServer`` owns one extender: model, scheduler, binder, event recorder, the informers, the
handshake loop and the requeue nudges (``hamipy.extender.requeue``). The background ones run under
a ``Supervisor`` (``hamipy.telemetry.supervision``), started in the app's ``cleanup_ctx`` as named
tasks and cancelled on shutdown (SIGTERM: readiness fails first, in-flight requests drain). A task that dies
is logged by name and, from then on, ``/readyz`` answers 503 with the reason and ``/filter``,
``/prioritize`` and ``/bind`` answer 503 with ``{"Error": reason}`` instead of a decision: the
model is no longer kept current, so no decision is made from it (``hamipy-extender serve`` then
exits with status 1).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import Any, Final, Self

import msgspec
from aiohttp import web

from hamipy.extender.binding import Binder
from hamipy.extender.errors import ExtenderError
from hamipy.extender.eviction import Evictor
from hamipy.extender.filter_args import watched_filter_args
from hamipy.extender.leadership import FORWARDED_HEADER, LEADER_URL_ANNOTATION, REDIRECTED_QUERY, Leadership
from hamipy.extender.model import ClusterModel
from hamipy.extender.requeue import Requeuer
from hamipy.extender.role_label import RoleLabel
from hamipy.extender.scheduler import BadRequest, Scheduler
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import SERVICE_NAME, Telemetry
from hamipy.extender.watching import Resource, model_informers, stamp_handshakes
from hamipy.kube.client import KubeApi
from hamipy.kube.events import DropReason, EventRecorder
from hamipy.kube.informer import Informer
from hamipy.kube.leader import LeaderElector, LeaseSettings
from hamipy.protocol.config import Config
from hamipy.telemetry.heap import heap_trimmer, trim_heap_forever
from hamipy.telemetry.http_limits import BoundedServer, HttpLimits, start_bounded_site
from hamipy.telemetry.json_bodies import BadJson, ListOf, MapOf, Shape, decode_json, shape_problem
from hamipy.telemetry.probes import ProbeServer, metrics_response, start_probe_server
from hamipy.telemetry.supervision import Supervisor

__all__ = ["HEALTH", "SCHEDULER", "ExtenderServer", "Health", "http_limits", "make_app"]

_JSON: Final = "application/json"
UNAVAILABLE_REASON: Final = "BackgroundTaskDied"
"""The ``reason`` label of decisions refused because a background task died."""


class Health:
    """Whether this extender may decide and whether it is ready: what ``/readyz`` and the decision
    routes consult. ``informers`` by resource (none when running without the cluster: then the
    model counts as listed once it was fed both resources)."""

    def __init__(
        self,
        *,
        model: ClusterModel,
        supervisor: Supervisor,
        informers: Mapping[Resource, Informer] | None = None,
    ) -> None:
        self.model = model
        self.supervisor = supervisor
        self.informers = dict(informers or {})
        self.stopping = asyncio.Event()
        self.watching = True
        """False while a cold standby has not led yet (its informers are not started)."""

    def broken(self) -> str | None:
        """Why decisions are refused (a background task died: the model may be stale), or None."""
        return self.supervisor.failure

    def synced(self) -> bool:
        """Whether the model holds the cluster: every informer has listed (and, without informers,
        the model was fed nodes and pods)."""
        return all(i.listed.is_set() for i in self.informers.values()) and self.model.synced

    def not_ready(self) -> str | None:
        """Why ``/readyz`` fails, or None when ready."""
        if self.stopping.is_set():
            return "stopping"
        failure = self.broken()
        if failure is not None:
            return failure
        if not self.watching:
            return None  # a cold standby passes requests to the leader; it lists once it leads
        waiting = [name for name, informer in self.informers.items() if not informer.listed.is_set()]
        if waiting or not self.model.synced:
            return f"model not synced yet (listing {' and '.join(waiting or ['nodes', 'pods'])})"
        return None


SCHEDULER: Final = web.AppKey("scheduler", Scheduler)
HEALTH: Final = web.AppKey("health", Health)
LEADERSHIP: Final = web.AppKey("leadership", Leadership)
MAX_BODY: Final = web.AppKey("max_body_bytes", int)

_CONTAINER: Final[Shape] = {"name": str, "resources": {"limits": dict, "requests": dict}}
_META: Final[Shape] = {
    "name": str,
    "namespace": str,
    "uid": str,
    "annotations": MapOf(str),
    "labels": MapOf(str),
}
_ARGS: Final[Shape] = {
    "Pod": {
        "metadata": _META,
        "spec": {
            "containers": ListOf(_CONTAINER),
            "initContainers": ListOf(_CONTAINER),
            "schedulerName": str,
            "nodeName": str,
        },
    },
    "NodeNames": ListOf(str),
    "Nodes": {"items": ListOf({"metadata": _META, "spec": dict, "status": {"allocatable": dict}})},
}
"""ExtenderArgs: the JSON types of the fields ``Scheduler`` reads (values of the resource maps are
``hamipy.protocol``'s to judge, and refused with the pod's Event when malformed)."""
_BINDING_ARGS: Final[Shape] = {"PodName": str, "PodNamespace": str, "PodUID": str, "Node": str}


async def _json_body(request: web.Request, shape: Shape) -> Any:
    """The request's JSON argument, its fields of ``shape`` checked; ``BadRequest`` otherwise."""
    return _decoded(await _body(request), shape)


async def _body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"request body larger than {request.app[MAX_BODY]} bytes") from None


def _decoded(body: bytes, shape: Shape) -> Any:
    try:
        args = decode_json(body)
    except BadJson as exc:
        raise BadRequest(str(exc)) from None
    problem = shape_problem(args, shape, "body")
    if problem is not None:
        raise BadRequest(problem)
    return args


def _bad(request: web.Request, exc: BadRequest) -> web.Response:
    request.app[SCHEDULER].telemetry.logger.warning(
        "bad request", path=request.path, remote=request.remote, error=str(exc)
    )
    request.app[SCHEDULER].telemetry.metrics.decisions.labels(
        verb=request.path.strip("/"), result="bad-request", reason="BadRequest"
    ).inc()
    return web.json_response({"Error": str(exc)}, status=400)


def _refused(request: web.Request) -> web.Response | None:
    """HTTP 503 with the reason when a background task died (the model is no longer kept current),
    else None. The body is a filter, prioritize or bind result with only ``Error`` set."""
    failure = request.app[HEALTH].broken()
    if failure is None:
        return None
    request.app[SCHEDULER].telemetry.metrics.decisions.labels(
        verb=request.path.strip("/"), result="unavailable", reason=UNAVAILABLE_REASON
    ).inc()
    error = f"extender unavailable, its cluster model is no longer kept current: {failure}"
    return web.json_response({"Error": error}, status=503)


async def _to_leader(request: web.Request) -> web.Response | None:
    """When another replica leads: its answer to this request (forwarded), else None (decide here).
    A request already forwarded is never forwarded again (a stale view of who leads)."""
    leadership = request.app[LEADERSHIP]
    if leadership.deciding():
        return None
    if request.headers.get(FORWARDED_HEADER) or REDIRECTED_QUERY in request.query:
        error = f"this extender ({leadership.identity}) is not the leader"
        return web.json_response({"Error": error}, status=503)
    if leadership.redirects:
        # The body is never read: kube-scheduler sends it again to the leader.
        answer = await leadership.redirect(request.path)
        if answer.location is not None:
            return web.Response(status=answer.status, headers={"Location": answer.location})
        return web.Response(status=answer.status, body=answer.body, content_type=_JSON)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _bad(request, BadRequest(f"request body larger than {request.app[MAX_BODY]} bytes"))
    answer = await leadership.forward(request.path, body)
    return web.Response(status=answer.status, body=answer.body, content_type=_JSON)


async def _decide(
    request: web.Request,
    verb: Callable[[Scheduler, Any], Any],
    light: Callable[[bytes, Callable[[str], bool]], Any] | None = None,
) -> web.Response:
    """A verb answered from the model alone (filter, prioritize, preempt), on the leader.
    ``light``: reads the arguments when it can without decoding all of them (None: it cannot)."""
    if (refused := _refused(request)) is not None:
        return refused
    if (forwarded := await _to_leader(request)) is not None:
        return forwarded
    scheduler = request.app[SCHEDULER]
    try:
        body = await _body(request)
        args = light(body, scheduler.watches) if light is not None else None
        if args is None:
            args = _decoded(body, _ARGS)
        result = verb(scheduler, args)
    except BadRequest as exc:
        return _bad(request, exc)
    return web.Response(body=msgspec.json.encode(result), content_type=_JSON)


async def _filter(request: web.Request) -> web.Response:
    return await _decide(request, Scheduler.filter, watched_filter_args)


async def _prioritize(request: web.Request) -> web.Response:
    return await _decide(request, Scheduler.prioritize)


async def _preempt(request: web.Request) -> web.Response:
    return await _decide(request, Scheduler.preempt)


async def _bind(request: web.Request) -> web.Response:
    if (refused := _refused(request)) is not None:
        return refused
    if (forwarded := await _to_leader(request)) is not None:
        return forwarded
    try:
        args = await _json_body(request, _BINDING_ARGS)
        result = await request.app[SCHEDULER].bind(args)
    except BadRequest as exc:
        return _bad(request, exc)
    return web.Response(body=msgspec.json.encode(result), content_type=_JSON)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _readyz(request: web.Request) -> web.Response:
    reason = request.app[HEALTH].not_ready()
    if reason is not None:
        return web.Response(status=503, text=reason)
    return web.Response(text="ok")


async def _metrics(request: web.Request) -> web.StreamResponse:
    return await metrics_response(request, await request.app[SCHEDULER].telemetry.metrics.render_chunks())


def lease_settings(settings: ExtenderSettings) -> LeaseSettings:
    """The Lease the replicas elect their leader by; ``ValueError`` when the times cannot fence (a
    leader's last bind must land before another replica can lead). The identity gets a random
    suffix: unique per process, as client-go advises (a restarted pod keeps its name)."""
    identity = f"{settings.identity or socket.gethostname()}_{secrets.token_hex(4)}"
    return LeaseSettings(
        namespace=settings.lease_namespace,
        name=settings.lease_name,
        identity=identity,
        lease_duration_s=settings.lease_duration_s,
        renew_deadline_s=settings.renew_deadline_s,
        retry_period_s=settings.retry_period_s,
        api_timeout_s=settings.api_timeout_s,
    )


def http_limits(settings: ExtenderSettings) -> HttpLimits:
    """The server's limits from ``settings``; ``ValueError`` when one is out of range."""
    return HttpLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        keepalive_timeout_s=settings.keepalive_timeout_s,
        max_connections=settings.max_connections,
        max_queued=settings.max_queued_connections,
    )


def make_app(
    scheduler: Scheduler, *, max_body_bytes: int, health: Health, leadership: Leadership | None = None
) -> web.Application:
    """The routes over one ``Scheduler`` (no background work: ``ExtenderServer`` adds that);
    without ``leadership`` this is the only replica."""
    app = web.Application(client_max_size=max_body_bytes)
    app[SCHEDULER] = scheduler
    app[MAX_BODY] = max_body_bytes
    app[HEALTH] = health
    if leadership is None:
        leadership = Leadership(election=False, api=None, model=None, telemetry=scheduler.telemetry)
    app[LEADERSHIP] = leadership
    app.router.add_post("/filter", _filter)
    app.router.add_post("/prioritize", _prioritize)
    app.router.add_post("/bind", _bind)
    app.router.add_post("/preempt", _preempt)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app


class ExtenderServer:
    """One running extender (``async with ExtenderServer(...) as server``); ``port`` once started.

    ``api`` None runs without the cluster (no watch, no bind): for benchmarks and unit tests that
    feed the model themselves. ``supervisor.failed`` is set when a background task died.
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
        metrics_port: int | None = None,
        shutdown_timeout_s: float = 5.0,
        forward_ssl: ssl.SSLContext | None = None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.telemetry = telemetry
        self.api = api
        self.host = host
        self.requested_port = port
        self.ssl_context = ssl_context
        self.requested_metrics_port = metrics_port
        self.metrics_port: int | None = None
        self._probes: ProbeServer | None = None
        self.shutdown_timeout_s = shutdown_timeout_s
        self.model = ClusterModel(
            count_resource=config.nvidia.resource_count_name, names=config.nvidia.resource_names
        )
        telemetry.metrics.attach(self.model)
        self.supervisor = Supervisor(telemetry.logger)
        self.events = EventRecorder(
            api,
            component=SERVICE_NAME,
            logger=telemetry.logger,
            on_drop=self._event_dropped,
            size=settings.event_queue_size,
            timeout_s=settings.api_timeout_s,
        )
        self.informers: dict[Resource, Informer] = {}
        binder = None
        if api is not None:
            self.informers = model_informers(
                api, model=self.model, settings=settings, telemetry=telemetry, events=self.events
            )
        self.health = Health(model=self.model, supervisor=self.supervisor, informers=self.informers)
        election = settings.leader_election and api is not None
        cold = election and settings.cold_standby
        self.health.watching = not cold
        self.leadership = Leadership(
            election=election,
            api=api,
            model=self.model,
            telemetry=telemetry,
            forward_ssl=forward_ssl,
            redirects=settings.follower_redirect,
            forward_server_name=settings.peer_server_name or None,
            forward_timeout_s=settings.bind_timeout_s + 2 * settings.api_timeout_s,
            leader_wait_s=settings.leader_wait_s,
            api_timeout_s=settings.api_timeout_s,
            ready=self.health.synced,
            before_leading=self._watch_to_lead if cold else None,
        )
        if api is not None:
            binder = Binder(
                api=api,
                model=self.model,
                config=config,
                settings=settings,
                telemetry=telemetry,
                exclusive=self.leadership.exclusive,
            )
        evictor = None
        if api is not None and settings.preemption:
            evictor = Evictor(
                api=api,
                model=self.model,
                events=self.events,
                telemetry=telemetry,
                scheduler_name=config.scheduler_name,
                timeout_s=settings.api_timeout_s,
            )
        self.requeuer: Requeuer | None = None
        if api is not None and settings.requeue_interval_s > 0:
            self.requeuer = Requeuer(
                api=api,
                model=self.model,
                telemetry=telemetry,
                interval_s=settings.requeue_interval_s,
                timeout_s=settings.api_timeout_s,
            )
            self.model.on_freed = self.requeuer.freed
        self.scheduler = Scheduler(
            model=self.model,
            config=config,
            settings=settings,
            telemetry=telemetry,
            events=self.events,
            binder=binder,
            evictor=evictor,
            on_refused=self.requeuer.refused if self.requeuer is not None else None,
        )
        self.role_label: RoleLabel | None = None
        own_pod = settings.own_pod_ref()
        if api is not None and election and own_pod is not None:
            pod_namespace, pod_name = own_pod
            self.role_label = RoleLabel(
                api=api,
                namespace=pod_namespace,
                name=pod_name,
                deciding=self.leadership.deciding,
                telemetry=telemetry,
                interval_s=settings.retry_period_s,
                timeout_s=settings.api_timeout_s,
            )
        self.port = 0
        self._server: BoundedServer | None = None
        self._serving = asyncio.Event()

    def _event_dropped(self, reason: DropReason) -> None:
        self.telemetry.metrics.events_dropped.labels(reason=reason).inc()

    async def _background(self, app: web.Application) -> AsyncIterator[None]:
        self.supervisor.start("extender-events", self.events.run())
        if self.health.watching:
            self._start_watches()
        if self.leadership.election:
            self.supervisor.start("extender-leadership", self._lead())
        if self.role_label is not None:
            self.supervisor.start("extender-role-label", self.role_label.run())
        if self.scheduler.binder is not None:
            self.supervisor.start("extender-lock-sweep", self.scheduler.binder.sweeper.run())
        if self.requeuer is not None:
            self.supervisor.start("extender-requeue", self.requeuer.run())
        if self.api is not None and self.settings.handshake_interval_s > 0:
            stamping = stamp_handshakes(
                api=self.api, model=self.model, settings=self.settings, telemetry=self.telemetry
            )
            self.supervisor.start("extender-handshake", stamping)
        trim = heap_trimmer()
        if self.settings.heap_trim_interval_s > 0 and trim is not None:
            self.supervisor.start(
                "extender-heap-trim", trim_heap_forever(trim, self.settings.heap_trim_interval_s)
            )
        yield
        if self.scheduler.evictor is not None:
            await self.scheduler.evictor.close()
        await self.supervisor.stop()
        if self.leadership.elector is not None:
            await self.leadership.elector.release()  # another replica leads at once, not after the lease
        await self.leadership.close()
        await asyncio.to_thread(self.telemetry.shutdown)

    async def _time_gc(self, app: web.Application) -> AsyncIterator[None]:
        """The collector's pauses are timed while this server runs (the callbacks are process-wide)."""
        with self.telemetry.metrics.gc_pauses:
            yield

    def _start_watches(self) -> None:
        self.health.watching = True
        for resource, informer in self.informers.items():
            self.supervisor.start(f"extender-watch-{resource}", informer.run())

    async def _watch_to_lead(self) -> None:
        """A cold standby taking the Lease: its watches start (the first time) and it decides once
        they have listed the cluster (``Leadership.deciding``); until then it answers 503."""
        if not self.health.watching:
            self.telemetry.logger.info("leading from cold standby; listing the cluster")
            self._start_watches()
        await asyncio.gather(*(informer.listed.wait() for informer in self.informers.values()))

    async def _lead(self) -> None:
        """Join the leader election once serving (the URL published in the Lease needs the port),
        then run it and follow this replica's leadership."""
        await self._serving.wait()
        assert self.api is not None  # election is only set with the API
        elector = LeaderElector(
            self.api,
            lease_settings(self.settings),
            logger=self.telemetry.logger,
            annotations={LEADER_URL_ANNOTATION: self.settings.advertise_url or self.url},
        )
        self.leadership.elector = elector
        await asyncio.gather(elector.run(), self.leadership.run())

    async def start(self) -> None:
        app = make_app(
            self.scheduler,
            max_body_bytes=self.settings.max_body_bytes,
            health=self.health,
            leadership=self.leadership,
        )
        app.cleanup_ctx.extend((self._time_gc, self._background))
        self._server = await start_bounded_site(
            app,
            host=self.host,
            port=self.requested_port,
            limits=http_limits(self.settings),
            ssl_context=self.ssl_context,
            shutdown_timeout_s=self.shutdown_timeout_s,
        )
        self.port = self._server.port
        self._serving.set()
        self.telemetry.metrics.connections.add("api", self._server)
        if self.requested_metrics_port is not None:
            self._probes = await start_probe_server(
                host=self.host,
                port=self.requested_metrics_port,
                render=self.telemetry.metrics.render_chunks,
                not_ready=self.health.not_ready,
            )
            self.metrics_port = self._probes.port
            self.telemetry.metrics.connections.add("probes", self._probes.server)
        self.telemetry.logger.info(
            "extender serving",
            host=self.host,
            port=self.port,
            metrics_port=self.metrics_port,
            tls=self.ssl_context is not None,
            client_certificates=self.ssl_context is not None
            and self.ssl_context.verify_mode == ssl.CERT_REQUIRED,
            cooperative=self.settings.cooperative,
            release_lock_after_bind=self.settings.release_lock_after_bind,
            leader_election=self.settings.leader_election,
            identity=self.leadership.identity or None,
        )

    async def wait_synced(self, timeout_s: float = 30.0) -> None:
        """Return once Nodes and Pods are listed; ``ExtenderError`` when a background task died
        first, ``TimeoutError`` after ``timeout_s``."""
        listed = asyncio.gather(*(informer.listed.wait() for informer in self.informers.values()))
        failed = asyncio.ensure_future(self.supervisor.failed.wait())
        waiters: set[asyncio.Future[Any]] = {listed, failed}
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listed.cancel()
            failed.cancel()
        if self.supervisor.failure is not None:
            raise ExtenderError(f"the extender cannot sync: {self.supervisor.failure}")

    async def stop(self) -> None:
        """Fail readiness, drain in-flight requests, stop the background tasks."""
        self.health.stopping.set()
        if self._server is not None:
            await self._server.close()
            self._server = None
        if self._probes is not None:
            await self._probes.close()
            self._probes = None
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
