"""The extender's routes, answered alike over HTTP/1.1 (aiohttp, ``make_app``) and over HTTP/2
(``Routes.respond_http2``, for ``hamipy.telemetry.http2``): kube-scheduler's Go client chooses
HTTP/2 when the decision port offers it over TLS, and then sends every request on one connection.

``POST /filter``, ``/prioritize``, ``/bind``, ``/preempt`` (extender JSON, Go field names);
``GET /healthz``, ``/readyz``, ``/metrics``. A body that is not the expected argument
(``hamipy.extender.extender_args``: not JSON, or a field the decisions read with the wrong JSON
type, named by its path), or over ``max_body_bytes``, gets HTTP 400 with the reason;
kube-scheduler counts that as an extender error for the pod and retries it. A filter of a pod the pod
watch has not delivered yet waits for it first (``hamipy.extender.pod_arrivals``). When a background task
died the decision routes answer 503 with ``{"Error": reason}``; on a replica that does not lead they
forward the request to the leader or redirect kube-scheduler there (``hamipy.extender.leadership``).
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hamipy.extender.errors import BadRequest
from hamipy.extender.extender_args import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderPreemptionArgs,
    decode_args,
)
from hamipy.extender.health import Health
from hamipy.extender.leadership import FORWARDED_HEADER, REDIRECTED_QUERY, Leadership
from hamipy.extender.pod_arrivals import PodArrivals
from hamipy.extender.scheduler import Scheduler
from hamipy.telemetry.http2 import Http2Answer, Http2Request
from hamipy.telemetry.probes import metrics_response

__all__ = ["ROUTES", "UNAVAILABLE_REASON", "Answer", "Call", "Routes", "make_app"]

_JSON: Final = "application/json"
_TEXT: Final = "text/plain; charset=utf-8"
UNAVAILABLE_REASON: Final = "BackgroundTaskDied"
"""The ``reason`` label of decisions refused because a background task died."""


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """A decision request as the routes see it, from either protocol."""

    verb: str
    """``filter``, ``prioritize``, ``bind`` or ``preempt``."""
    forwarded: bool
    """Sent on by another replica (``FORWARDED_HEADER`` or ``REDIRECTED_QUERY``): never sent on again."""
    remote: str | None
    read: Callable[[], Awaitable[bytes]]
    """The body; ``BadRequest`` when it is larger than ``max_body_bytes``. Not called for a
    redirect (kube-scheduler sends the body again to the leader)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    location: str | None = None


class Routes:
    """The decision routes over one ``Scheduler``; without ``leadership`` this is the only replica."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        health: Health,
        max_body_bytes: int,
        leadership: Leadership | None = None,
        arrivals: PodArrivals | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.health = health
        self.max_body_bytes = max_body_bytes
        self.arrivals = arrivals
        """Where a filter of a pod the watch has not delivered yet waits for it (None: no wait)."""
        if leadership is None:
            leadership = Leadership(election=False, api=None, model=None, telemetry=scheduler.telemetry)
        self.leadership = leadership

    async def answer(self, call: Call) -> Answer:
        """The answer to a decision request."""
        if (refused := self._refused(call)) is not None:
            return refused
        if (forwarded := await self._to_leader(call)) is not None:
            return forwarded
        scheduler = self.scheduler
        try:
            body = await call.read()
            result: Any
            if call.verb == "bind":
                result = await scheduler.bind(decode_args(body, ExtenderBindingArgs))
            elif call.verb == "preempt":
                result = scheduler.preempt(decode_args(body, ExtenderPreemptionArgs))
            else:
                args = decode_args(body, ExtenderArgs)
                if call.verb == "filter" and self.arrivals is not None:
                    await self.arrivals.wait(args.pod.metadata)  # then decided from the watched pod
                result = scheduler.filter(args) if call.verb == "filter" else scheduler.prioritize(args)
        except BadRequest as exc:
            return self._bad(call, exc)
        return Answer(200, msgspec.json.encode(result))

    async def respond_http2(self, request: Http2Request) -> Http2Answer:
        """``answer``, or a probe's or the metrics' answer, to a request that came over HTTP/2."""
        verb = request.path.strip("/")
        if verb in _VERBS or verb == "bind":
            if request.method != "POST":
                return Http2Answer(405, b"", content_type=None, headers={"allow": "POST"})

            async def read() -> bytes:
                if request.too_large:
                    raise BadRequest(self.too_large())
                return request.body

            forwarded = FORWARDED_HEADER.lower() in request.headers
            forwarded = forwarded or _has_key(request.query, REDIRECTED_QUERY)
            call = Call(verb=verb, forwarded=forwarded, remote=request.remote, read=read)
            answer = await self.answer(call)
            location = {"location": answer.location} if answer.location is not None else {}
            return Http2Answer(answer.status, answer.body, headers=location)
        if request.method not in ("GET", "HEAD") or verb not in ("healthz", "readyz", "metrics"):
            return Http2Answer(404, b"not found", content_type=_TEXT)
        if verb == "metrics":
            chunks = await self.scheduler.telemetry.metrics.render_chunks()
            return Http2Answer(200, b"".join(chunks), content_type=CONTENT_TYPE_LATEST)
        reason = self.health.not_ready() if verb == "readyz" else None
        if reason is not None:
            return Http2Answer(503, reason.encode(), content_type=_TEXT)
        return Http2Answer(200, b"ok", content_type=_TEXT)

    def too_large(self) -> str:
        """The reason a body over ``max_body_bytes`` is refused."""
        return f"request body larger than {self.max_body_bytes} bytes"

    def _bad(self, call: Call, exc: BadRequest) -> Answer:
        self.scheduler.telemetry.logger.warning(
            "bad request", path=f"/{call.verb}", remote=call.remote, error=str(exc)
        )
        self.scheduler.telemetry.metrics.decisions.labels(
            verb=call.verb, result="bad-request", reason="BadRequest"
        ).inc()
        return _error(400, str(exc))

    def _refused(self, call: Call) -> Answer | None:
        """HTTP 503 with the reason when a background task died (the model is no longer kept
        current), else None. The body is a filter, prioritize or bind result with only ``Error`` set."""
        failure = self.health.broken()
        if failure is None:
            return None
        self.scheduler.telemetry.metrics.decisions.labels(
            verb=call.verb, result="unavailable", reason=UNAVAILABLE_REASON
        ).inc()
        return _error(503, f"extender unavailable, its cluster model is no longer kept current: {failure}")

    async def _to_leader(self, call: Call) -> Answer | None:
        """When another replica leads: its answer to this request (forwarded), else None (decide
        here). A request already forwarded is never forwarded again (a stale view of who leads)."""
        leadership = self.leadership
        if leadership.deciding():
            return None
        if call.forwarded:
            return _error(503, f"this extender ({leadership.identity}) is not the leader")
        path = f"/{call.verb}"
        if leadership.redirects:
            # The body is never read: kube-scheduler sends it again to the leader.
            redirect = await leadership.redirect(path)
            return Answer(redirect.status, redirect.body, redirect.location)
        try:
            body = await call.read()
        except BadRequest as exc:
            return self._bad(call, exc)
        forwarded = await leadership.forward(path, body)
        return Answer(forwarded.status, forwarded.body)


_VERBS: Final = ("filter", "prioritize", "preempt")
"""The verbs answered from the model alone (``bind`` writes, and is awaited)."""


def _has_key(query: str, key: str) -> bool:
    """Whether ``query`` names ``key`` (with a value or not), as aiohttp's parsed query would."""
    return any(name == key for name, _ in urllib.parse.parse_qsl(query, keep_blank_values=True))


def _error(status: int, error: str) -> Answer:
    return Answer(status, msgspec.json.encode({"Error": error}))


# -- HTTP/1.1 (aiohttp) ---------------------------------------------------------------------------

ROUTES: Final = web.AppKey("routes", Routes)


def _aiohttp_call(request: web.Request, verb: str) -> Call:
    async def read() -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(request.app[ROUTES].too_large()) from None

    forwarded = bool(request.headers.get(FORWARDED_HEADER)) or REDIRECTED_QUERY in request.query
    return Call(verb=verb, forwarded=forwarded, remote=request.remote, read=read)


def _route(verb: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        answer = await request.app[ROUTES].answer(_aiohttp_call(request, verb))
        if answer.location is not None:
            return web.Response(status=answer.status, headers={"Location": answer.location})
        return web.Response(status=answer.status, body=answer.body, content_type=_JSON)

    return handle


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _readyz(request: web.Request) -> web.Response:
    reason = request.app[ROUTES].health.not_ready()
    if reason is not None:
        return web.Response(status=503, text=reason)
    return web.Response(text="ok")


async def _metrics(request: web.Request) -> web.StreamResponse:
    metrics = request.app[ROUTES].scheduler.telemetry.metrics
    return await metrics_response(request, await metrics.render_chunks())


def make_app(routes: Routes) -> web.Application:
    """The routes served by aiohttp (no background work: ``ExtenderServer`` adds that)."""
    app = web.Application(client_max_size=routes.max_body_bytes)
    app[ROUTES] = routes
    for verb in (*_VERBS, "bind"):
        app.router.add_post(f"/{verb}", _route(verb))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app
