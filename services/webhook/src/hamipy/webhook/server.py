"""The HTTPS server the kube-apiserver calls: ``POST /webhook``, health, readiness and metrics.

TLS comes from a certificate and key on disk (a mounted Secret), reloaded when the files change:
the ``certificate-watch`` task compares the files' stat stamps every ``cert_check_interval_s`` and
loads a fresh ``SSLContext`` when they changed; every handshake runs an SNI callback (OpenSSL calls
it with or without SNI) that hands the connection the current context, so handshakes never touch
the disk. A half-written rotation (certificate and key that do not match) is logged and counted
once, and tried again when the files change again, while the old pair keeps serving.

The server's own long-lived tasks (the certificate watch) run under a
``hamipy.serving.supervision.Supervisor``: one that dies is logged by name, ``/readyz`` answers
503 with the failure from then on, and ``supervisor.failed`` tells ``cli`` to end the process with
status 1, so the pod is restarted instead of serving with a certificate nobody watches.

    Exception
     └── CertificateError     the serving certificate or key cannot be loaded at start-up

Bodies over ``max_body_bytes``, and bodies that are not an AdmissionReview, get HTTP 400 with a
reason (``admitting.Admitter.bad_request``); the server keeps serving.

Any pod can reach this server, so both ports run under ``hamipy.serving.http_limits``: a client
that is slow to send its request (TLS handshake included) or its body is cut after
``limits.header_timeout_s`` / ``body_timeout_s``, an idle one after ``keepalive_timeout_s``, and at
most ``max_connections`` are held per port, a newcomer closing an idle connection or the longest sender
(so slow or idle clients cannot keep the API server's calls out). A client that leaves mid-request
is one log line (``client left mid-request``, with the port's name as ``server``). The kubelet's
probes belong on the plain ``metrics_port``: any pod can reach it too, but it has its own cap, apart
from the TLS port's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Final, Self

from aiohttp import web

from hamipy.protocol.settings import tuning, user
from hamipy.serving.http_limits import BoundedServer, HttpLimits, start_bounded_site
from hamipy.serving.probes import add_probe_routes
from hamipy.serving.supervision import Supervisor
from hamipy.serving.tls import serving_context
from hamipy.webhook.admitting import Admitter
from hamipy.webhook.errors import CertificateError

__all__ = [
    "ADMITTER",
    "MAX_BODY",
    "CertificateError",
    "CertificateStore",
    "ServerSettings",
    "WebhookServer",
    "make_app",
    "make_probe_app",
]

ADMITTER: Final = web.AppKey("admitter", Admitter)
MAX_BODY: Final = web.AppKey("max_body_bytes", int)
_JSON: Final = "application/json"


@dataclasses.dataclass(frozen=True, slots=True)
class ServerSettings:
    """Where and how to serve; each setting declared once with its flag (``hamipy.protocol.settings``)."""

    cert_file: Path = user(
        Path("/etc/hamipy-webhook/tls/tls.crt"), "PEM serving certificate, reloaded when it changes"
    )
    """PEM serving certificate (chain) for the Service DNS names (``tls.crt`` of the Secret)."""
    key_file: Path = user(Path("/etc/hamipy-webhook/tls/tls.key"), "PEM private key of --cert-file")
    host: str = user("0.0.0.0", "listen address")
    """All interfaces, as a pod serves its Service."""
    port: int = user(8443, "HTTPS port")
    """0 picks a free one. Unprivileged, so the container needs no capability."""
    metrics_port: int | None = user(
        None, "also serve /metrics, /healthz, /readyz over plain HTTP on this port"
    )
    """For Prometheus and probes without TLS; None serves them on the HTTPS port only."""
    max_body_bytes: int = tuning(4 * 1024 * 1024, "largest AdmissionReview accepted (larger: HTTP 400)")
    """The apiserver caps an object at about 1.5 MiB in etcd and a request at 3 MiB; 4 MiB leaves room
    for the review around it."""
    limits: HttpLimits = HttpLimits()
    """Of both ports. The API servers keep a few tens of connections; 256 slow TLS clients cost
    about 115 MiB, within the chart's 256 Mi limit."""
    cert_check_interval_s: float = 1.0
    """How often the certificate files are checked for a rotation: a stat of two files a second
    costs nothing, and the kubelet takes far longer to update a mounted Secret."""
    shutdown_timeout_s: float = 10.0
    """Time in-flight admissions get to finish after SIGTERM (the apiserver's timeout is <= 30 s)."""

    def __post_init__(self) -> None:
        if not self.cert_check_interval_s > 0:
            raise ValueError(f"cert_check_interval_s must be > 0 (got {self.cert_check_interval_s})")


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class CertificateStore:
    """The serving TLS context, reloaded from ``cert_file``/``key_file`` when they change (``watch``
    checks every ``check_interval_s``; ``refresh`` checks now).

    ``on_reload(ok, error)`` is called after each reload attempt (for the log and a counter).
    """

    def __init__(
        self,
        cert_file: Path,
        key_file: Path,
        *,
        check_interval_s: float = 1.0,
        on_reload: Callable[[bool, str | None], None] | None = None,
    ) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.check_interval_s = check_interval_s
        self._on_reload = on_reload
        self._failed: object = None
        """The files' state (stamps, or a stat error) last reported as failed."""
        try:
            self._stamps = (_stamp(cert_file), _stamp(key_file))
            self._current = self._load()
        except (OSError, ssl.SSLError) as exc:
            raise CertificateError(
                f"cannot load serving certificate {cert_file} / key {key_file}: {exc}"
            ) from exc
        self.ssl_context = self._current
        self.ssl_context.sni_callback = self._on_hello
        self.reloads = 0

    def _load(self) -> ssl.SSLContext:
        return serving_context(self.cert_file, self.key_file)

    @property
    def current(self) -> ssl.SSLContext:
        """The context new connections are served with."""
        return self._current

    async def watch(self) -> None:
        """Check the files every ``check_interval_s``, forever (a supervised task)."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            self.refresh()

    def refresh(self) -> bool:
        """Reload now if the files changed; True when a new certificate was loaded."""
        try:
            stamps = (_stamp(self.cert_file), _stamp(self.key_file))
        except OSError as exc:  # mid-rotation (symlink swap) or removed: keep serving the old pair
            self._fail(str(exc), f"cannot stat certificate files: {exc}")
            return False
        if stamps == self._stamps:
            self._failed = None  # back to the files being served: a later failure is news
            return False
        if stamps == self._failed:
            return False
        try:
            fresh = self._load()
        except (OSError, ssl.SSLError) as exc:
            self._fail(stamps, f"cannot load new certificate: {exc}")
            return False
        self._failed = None
        self._stamps = stamps
        self._current = fresh
        self.reloads += 1
        self._report(True, None)
        return True

    def _fail(self, state: object, error: str) -> None:
        """Report a failed check once per state of the files (not every ``check_interval_s``)."""
        if state != self._failed:
            self._failed = state
            self._report(False, error)

    def _report(self, ok: bool, error: str | None) -> None:
        if self._on_reload is not None:
            self._on_reload(ok, error)

    def _on_hello(self, sslobj: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        # The listening socket keeps the first context: each connection gets the current one.
        if self._current is not ctx:
            sslobj.context = self._current


# -- handlers ---------------------------------------------------------------------------------------------


async def _webhook(request: web.Request) -> web.Response:
    admitter = request.app[ADMITTER]
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY]
        answer = admitter.bad_request(
            "too_large", f"request body larger than {limit} bytes", remote=request.remote
        )
        return web.Response(status=answer.status, body=answer.body, content_type=_JSON)
    answer = admitter.admit(body, remote=request.remote, headers=request.headers)
    return web.Response(status=answer.status, body=answer.body, content_type=_JSON)


def make_app(
    admitter: Admitter,
    *,
    max_body_bytes: int = 4 * 1024 * 1024,
    ready: asyncio.Event | None = None,
    supervisor: Supervisor | None = None,
) -> web.Application:
    """The webhook application: ``POST /webhook``, ``GET /healthz``, ``/readyz``, ``/metrics``.

    ``ready`` and ``supervisor`` are shared with the probe app; the server sets ``ready`` once
    listening and clears it when shutting down, so readiness fails before in-flight requests are
    drained; a supervised task that died fails readiness for good.
    """
    app = web.Application(client_max_size=max_body_bytes)
    app[ADMITTER] = admitter
    app[MAX_BODY] = max_body_bytes
    app.router.add_post("/webhook", _webhook)
    _add_probes(app, admitter, ready, supervisor)
    return app


def make_probe_app(
    admitter: Admitter, *, ready: asyncio.Event, supervisor: Supervisor | None = None
) -> web.Application:
    """``/metrics``, ``/healthz`` and ``/readyz`` alone, for the optional plain-HTTP port."""
    app = web.Application(client_max_size=1024)
    _add_probes(app, admitter, ready, supervisor)
    return app


def _add_probes(
    app: web.Application, admitter: Admitter, ready: asyncio.Event | None, supervisor: Supervisor | None
) -> None:
    ready = ready if ready is not None else asyncio.Event()
    supervisor = supervisor if supervisor is not None else Supervisor(admitter.telemetry.logger)

    def not_ready() -> str | None:
        if supervisor.failure is not None:
            return f"not ready: {supervisor.failure}"
        return None if ready.is_set() else "not ready"

    async def render() -> bytes:
        return admitter.telemetry.metrics.render()

    add_probe_routes(app, render=render, not_ready=not_ready)


class WebhookServer:
    """The running server (``async with WebhookServer(settings, admitter) as server``).

    ``port`` is the bound HTTPS port (useful with port 0), ``metrics_port`` the plain one;
    ``supervisor`` runs the server's own tasks (``supervisor.failed``: one died, stop the process).
    """

    def __init__(self, settings: ServerSettings, admitter: Admitter) -> None:
        self.settings = settings
        self.admitter = admitter
        self.ready = asyncio.Event()
        telemetry = admitter.telemetry

        def on_reload(ok: bool, error: str | None) -> None:
            telemetry.metrics.certificate_reloads.labels(result="ok" if ok else "failed").inc()
            if ok:
                telemetry.logger.info("serving certificate reloaded", cert_file=str(settings.cert_file))
            else:
                telemetry.logger.error("serving certificate reload failed", error=error)

        self.certificates = CertificateStore(
            settings.cert_file,
            settings.key_file,
            check_interval_s=settings.cert_check_interval_s,
            on_reload=on_reload,
        )
        self.supervisor = Supervisor(telemetry.logger)
        self._servers: list[BoundedServer] = []
        self.port = 0
        self.metrics_port: int | None = None

    async def start(self) -> None:
        s = self.settings
        try:
            app = make_app(
                self.admitter, max_body_bytes=s.max_body_bytes, ready=self.ready, supervisor=self.supervisor
            )
            app.cleanup_ctx.append(self._telemetry_ctx)
            self.port = await self._start_site("api", app, s.port, self.certificates.ssl_context)
            if s.metrics_port is not None:
                probes = make_probe_app(self.admitter, ready=self.ready, supervisor=self.supervisor)
                self.metrics_port = await self._start_site("probes", probes, s.metrics_port, None)
            self.supervisor.start("certificate-watch", self.certificates.watch())
        except BaseException:
            await self.stop()
            raise
        self.ready.set()
        self.admitter.telemetry.logger.info(
            "webhook serving", host=s.host, port=self.port, metrics_port=self.metrics_port
        )

    async def _start_site(
        self, name: str, app: web.Application, port: int, ssl_context: ssl.SSLContext | None
    ) -> int:
        s = self.settings
        server = await start_bounded_site(
            app,
            host=s.host,
            port=port,
            limits=s.limits,
            ssl_context=ssl_context,
            shutdown_timeout_s=s.shutdown_timeout_s,
            logger=self.admitter.telemetry.logger.bind(server=name),
        )
        self._servers.append(server)
        self.admitter.telemetry.metrics.connections.add(name, server)
        return server.port

    async def _telemetry_ctx(self, app: web.Application) -> AsyncIterator[None]:
        yield
        # Flushes pending spans to the exporter (if any); blocking, so off the loop.
        await asyncio.to_thread(self.admitter.telemetry.shutdown)

    async def stop(self) -> None:
        """Fail readiness, then drain and close (probe port last, so probes see the drain)."""
        self.ready.clear()
        await self.supervisor.stop()
        for server in self._servers:
            await server.close()
        self._servers.clear()
        self.admitter.telemetry.logger.info("webhook stopped")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
