"""The HTTPS (or HTTP) server kube-scheduler calls, and the background work that keeps the model
current. The routes are in ``hamipy.extender.routes``; over TLS they are served over HTTP/1.1 and,
when the client offers it (kube-scheduler does), HTTP/2 (``hamipy.serving.http2``), which carries
all of kube-scheduler's requests on one connection instead of a TLS handshake for most of them.
Any pod can reach this server, so it runs under ``hamipy.serving.http_limits`` (header, body and
keep-alive timeouts, a connection cap; per connection at most ``http2.MAX_STREAMS`` HTTP/2 requests).

With ``metrics_port`` the same ``/healthz``, ``/readyz`` and ``/metrics`` are also served over plain
HTTP on a port of their own (``hamipy.serving.probes``), so that the decision port can demand
kube-scheduler's client certificate (``--tls-client-ca-file``) while the kubelet's probes and
Prometheus need none (docs/security.md).

``ExtenderServer`` owns one extender: model, scheduler, binder, event recorder, the informers, the
handshake loop and the requeue nudges (``hamipy.extender.requeue``). The background ones run under
a ``Supervisor`` (``hamipy.serving.supervision``), started in the app's ``cleanup_ctx`` as named
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
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from hamipy.extender.binding import Binder
from hamipy.extender.errors import ExtenderError
from hamipy.extender.eviction import Evictor
from hamipy.extender.health import Health
from hamipy.extender.leadership import LEADER_URL_ANNOTATION, Leadership
from hamipy.extender.model import ClusterModel
from hamipy.extender.pod_arrivals import PodArrivals
from hamipy.extender.requeue import Requeuer
from hamipy.extender.role_label import RoleLabel
from hamipy.extender.routes import Routes, make_app
from hamipy.extender.scheduler import Scheduler
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import SERVICE_NAME, Telemetry
from hamipy.extender.watching import Resource, model_informers, stamp_handshakes
from hamipy.kube.client import KubeApi, NullKube
from hamipy.kube.events import DropReason, EventRecorder
from hamipy.kube.informer import Informer
from hamipy.kube.leader import LeaderElector, LeaseSettings
from hamipy.protocol.config import Config
from hamipy.serving.heap import heap_trimmer, trim_heap_forever
from hamipy.serving.http2 import Http2App
from hamipy.serving.http_limits import BoundedServer, HttpLimits, start_bounded_site
from hamipy.serving.probes import start_probe_server
from hamipy.serving.supervision import Supervisor

__all__ = ["ExtenderServer", "lease_settings"]


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


class ExtenderServer:
    """One running extender (``async with ExtenderServer(...) as server``); ``port`` once started.

    With ``api`` a ``NullKube`` it runs without the cluster (no watch, bind, eviction, requeue,
    handshake or election): for benchmarks and unit tests that feed the model themselves.
    ``supervisor.failed`` is set when a background task died.
    """

    def __init__(
        self,
        *,
        config: Config,
        settings: ExtenderSettings,
        telemetry: Telemetry,
        api: KubeApi,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        metrics_port: int | None = None,
        shutdown_timeout_s: float = 5.0,
        forward_ssl: ssl.SSLContext | None = None,
        limits: HttpLimits = HttpLimits(),
    ) -> None:
        self.config = config
        self.settings = settings
        self.telemetry = telemetry
        self.api = api
        self.cluster = not isinstance(api, NullKube)
        """Whether a cluster is behind ``api``: only then are the parts that read or write it built."""
        self.host = host
        self.requested_port = port
        self.ssl_context = ssl_context
        self.requested_metrics_port = metrics_port
        self.metrics_port: int | None = None
        self._probes: BoundedServer | None = None
        self.shutdown_timeout_s = shutdown_timeout_s
        self.limits = limits
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
        self.arrivals = PodArrivals(
            held=lambda uid: uid in self.model.pending,
            reached=self._pods_version,
            wait_s=settings.watch_wait_s,
            metrics=telemetry.metrics,
        )
        """Filters of pods the pod watch has not delivered yet wait here (``pod_arrivals``)."""
        binder = None
        if self.cluster:
            self.informers = model_informers(
                api,
                model=self.model,
                settings=settings,
                telemetry=telemetry,
                events=self.events,
                on_change={"pods": self.arrivals.changed},
            )
        self.health = Health(model=self.model, supervisor=self.supervisor, informers=self.informers)
        election = settings.leader_election and self.cluster
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
        if self.cluster:
            binder = Binder(
                api=api,
                model=self.model,
                config=config,
                settings=settings,
                telemetry=telemetry,
                exclusive=self.leadership.exclusive,
            )
        evictor = None
        if self.cluster and settings.preemption:
            evictor = Evictor(
                api=api,
                model=self.model,
                events=self.events,
                telemetry=telemetry,
                scheduler_name=config.scheduler_name,
                timeout_s=settings.api_timeout_s,
            )
        self.requeuer: Requeuer | None = None
        if self.cluster and settings.requeue_interval_s > 0:
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
        if election and own_pod is not None:
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

    def _pods_version(self) -> str:
        """The resourceVersion the pod watch has reached ("" before it lists, or without one)."""
        informer = self.informers.get("pods")
        return informer.resource_version if informer is not None else ""

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
        if self.cluster and self.settings.handshake_interval_s > 0:
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
        elector = LeaderElector(
            self.api,
            lease_settings(self.settings),
            logger=self.telemetry.logger,
            annotations={LEADER_URL_ANNOTATION: self.settings.advertise_url or self.url},
        )
        self.leadership.elector = elector
        await asyncio.gather(elector.run(), self.leadership.run())

    async def start(self) -> None:
        routes = Routes(
            self.scheduler,
            health=self.health,
            max_body_bytes=self.settings.max_body_bytes,
            leadership=self.leadership,
            arrivals=self.arrivals,
        )
        app = make_app(routes)
        app.cleanup_ctx.extend((self._time_gc, self._background))
        http2 = None
        if self.ssl_context is not None and self.settings.http2:
            http2 = Http2App(routes.respond_http2, max_body_bytes=self.settings.max_body_bytes)
        self._server = await start_bounded_site(
            app,
            host=self.host,
            port=self.requested_port,
            limits=self.limits,
            ssl_context=self.ssl_context,
            shutdown_timeout_s=self.shutdown_timeout_s,
            http2=http2,
            logger=self.telemetry.logger.bind(server="api"),
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
            self.telemetry.metrics.connections.add("probes", self._probes)
        self.telemetry.logger.info(
            "extender serving",
            host=self.host,
            port=self.port,
            metrics_port=self.metrics_port,
            tls=self.ssl_context is not None,
            http2=http2 is not None,
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
