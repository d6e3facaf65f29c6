"""The extender's routes: one table (``TABLE``, method and path to a handler of a ``Call``) that
both protocols dispatch from (``Routes.dispatch``), HTTP/1.1 through aiohttp (``make_app``) and
HTTP/2 through ``Routes.respond_http2`` (for ``hamipy.serving.http2``): kube-scheduler's Go client
chooses HTTP/2 when the decision port offers it over TLS, and then sends every request on one
connection. A path the table lacks is answered 404, a method it lacks for the path 405.

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
from collections.abc import Awaitable, Callable, Mapping, Sequence
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
from hamipy.serving.http2 import Http2Answer, Http2Request
from hamipy.serving.probes import streamed_response

__all__ = ["ROUTES", "TABLE", "UNAVAILABLE_REASON", "Answer", "Call", "Routes", "make_app"]

_JSON: Final = "application/json"
_TEXT: Final = "text/plain; charset=utf-8"
UNAVAILABLE_REASON: Final = "BackgroundTaskDied"
"""The ``reason`` label of decisions refused because a background task died."""


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """A request as the routes see it, from either protocol."""

    method: str
    path: str
    """Without the query."""
    forwarded: bool
    """Sent on by another replica (``FORWARDED_HEADER`` or ``REDIRECTED_QUERY``): never sent on again."""
    remote: str | None
    read: Callable[[], Awaitable[bytes]]
    """The body; ``BadRequest`` when it is larger than ``max_body_bytes``. Not called for a
    redirect (kube-scheduler sends the body again to the leader)."""

    @property
    def verb(self) -> str:
        """A decision route's: ``filter``, ``prioritize``, ``bind`` or ``preempt``."""
        return self.path.strip("/")


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """What both protocols send: the body whole, or in chunks written one by one (``/metrics``)."""

    status: int
    body: bytes | Sequence[bytes]
    content_type: str | None = _JSON
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Lower-case names, as HTTP/2 has them."""


class Routes:
    """The decision routes over one ``Scheduler``; ``leadership`` says whether this replica decides
    or forwards."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        health: Health,
        max_body_bytes: int,
        leadership: Leadership,
        arrivals: PodArrivals | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.health = health
        self.max_body_bytes = max_body_bytes
        self.arrivals = arrivals
        """Where a filter of a pod the watch has not delivered yet waits for it (None: no wait)."""
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

    async def dispatch(self, call: Call) -> Answer:
        """The answer of the handler ``TABLE`` gives the call's method (a HEAD's: its GET's) and
        path."""
        handler = TABLE.get(("GET" if call.method == "HEAD" else call.method, call.path))
        if handler is not None:
            return await handler(self, call)
        allowed = [method for method, path in TABLE if path == call.path]
        if allowed:
            return Answer(405, b"method not allowed", _TEXT, {"allow": ", ".join(allowed)})
        return Answer(404, b"not found", _TEXT)

    async def respond_http2(self, request: Http2Request) -> Http2Answer:
        """``dispatch`` for a request that came over HTTP/2."""

        async def read() -> bytes:
            if request.too_large:
                raise BadRequest(self.too_large())
            return request.body

        query = urllib.parse.parse_qs(request.query, keep_blank_values=True)
        forwarded = FORWARDED_HEADER.lower() in request.headers or REDIRECTED_QUERY in query
        answer = await self.dispatch(Call(request.method, request.path, forwarded, request.remote, read))
        return Http2Answer(answer.status, answer.body, answer.content_type, answer.headers)

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
            if redirect.location is None:
                return Answer(redirect.status, redirect.body)
            return Answer(redirect.status, b"", None, {"location": redirect.location})
        try:
            body = await call.read()
        except BadRequest as exc:
            return self._bad(call, exc)
        forwarded = await leadership.forward(path, body)
        return Answer(forwarded.status, forwarded.body)


_VERBS: Final = ("filter", "prioritize", "preempt")
"""The verbs answered from the model alone (``bind`` writes, and is awaited)."""


def _error(status: int, error: str) -> Answer:
    return Answer(status, msgspec.json.encode({"Error": error}))


async def _healthz(routes: Routes, call: Call) -> Answer:
    return Answer(200, b"ok", _TEXT)


async def _readyz(routes: Routes, call: Call) -> Answer:
    reason = routes.health.not_ready()
    return Answer(200, b"ok", _TEXT) if reason is None else Answer(503, reason.encode(), _TEXT)


async def _metrics(routes: Routes, call: Call) -> Answer:
    chunks = await routes.scheduler.telemetry.metrics.render_chunks()
    return Answer(200, chunks, CONTENT_TYPE_LATEST)


TABLE: Final[Mapping[tuple[str, str], Callable[[Routes, Call], Awaitable[Answer]]]] = {
    **{("POST", f"/{verb}"): Routes.answer for verb in (*_VERBS, "bind")},
    ("GET", "/healthz"): _healthz,
    ("GET", "/readyz"): _readyz,
    ("GET", "/metrics"): _metrics,
}
"""Every route of the decision port, by method and path."""


# -- HTTP/1.1 (aiohttp) ---------------------------------------------------------------------------

ROUTES: Final = web.AppKey("routes", Routes)


async def _respond_http1(request: web.Request) -> web.StreamResponse:
    """``dispatch`` for a request that came over HTTP/1.1."""
    routes = request.app[ROUTES]

    async def read() -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(routes.too_large()) from None

    forwarded = FORWARDED_HEADER in request.headers or REDIRECTED_QUERY in request.query
    answer = await routes.dispatch(Call(request.method, request.path, forwarded, request.remote, read))
    headers = dict(answer.headers)
    if answer.content_type is not None:
        headers["Content-Type"] = answer.content_type
    return await streamed_response(request, answer.body, status=answer.status, headers=headers)


def make_app(routes: Routes) -> web.Application:
    """The routes served by aiohttp (no background work: ``ExtenderServer`` adds that)."""
    app = web.Application(client_max_size=routes.max_body_bytes)
    app[ROUTES] = routes
    app.router.add_route("*", "/{path:.*}", _respond_http1)
    return app
