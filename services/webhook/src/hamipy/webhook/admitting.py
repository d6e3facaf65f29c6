"""One admission, end to end but without HTTP: body in, HTTP status and JSON answer out.

Decodes the review in one pass (``admission.decode_review``: a body it cannot read, the pod's
fields included, is an HTTP 400 naming the bad field), opens the admission span (continuing the
pod's trace when it already carries one, else the API server's when its request carried a
``traceparent``, linked to the other), runs the pure ``mutation.decide``, encodes the answer in
the version asked, and reports the outcome to the log, the metrics and the span. The server only
moves bytes; the benchmark times exactly this.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from hamipy.protocol import keys
from hamipy.protocol.kube_objects import plain
from hamipy.telemetry import incoming_context, traceparent_context, traceparent_of
from hamipy.webhook.admission import AdmissionReview, BadReview, Review, decode_review, encode_response
from hamipy.webhook.mutation import Decision, MutationSettings, decide
from hamipy.webhook.telemetry import Telemetry

__all__ = ["Admitter", "Answer", "pod_identity"]


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """What to send back: the HTTP status and the JSON body (an AdmissionReview, or for a bad
    request an error object ``{"error": reason, "message": ...}``)."""

    status: int
    body: bytes
    decision: Decision | None = None


def pod_identity(review: Review) -> dict[str, str]:
    """namespace/name/uid for logs. At creation a pod may have only ``generateName``, shown as
    ``prefix*``; ``uid`` is the admission request's (the pod has none yet)."""
    request = review.request
    metadata = review.pod.metadata if review.pod is not None else None
    name = request.name or (metadata.name if metadata is not None else None)
    if not name and metadata is not None and metadata.generate_name:
        name = f"{metadata.generate_name}*"
    namespace = request.namespace or (metadata.namespace if metadata is not None else None)
    return {"namespace": namespace or "", "name": name or "", "uid": review.uid}


def _dump(doc: AdmissionReview | dict[str, str]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


class Admitter:
    """Answers AdmissionReview bodies with ``settings``, reporting through ``telemetry``."""

    def __init__(self, settings: MutationSettings, telemetry: Telemetry) -> None:
        self.settings = settings
        self.telemetry = telemetry

    def bad_request(self, reason: str, message: str, *, remote: str | None = None) -> Answer:
        """The HTTP 400 answer for a request we cannot read, logged and counted."""
        self.telemetry.metrics.bad_requests.labels(reason=reason).inc()
        self.telemetry.logger.warning("bad admission request", reason=reason, error=message, remote=remote)
        return Answer(400, _dump({"error": reason, "message": message}))

    def admit(
        self, body: bytes, *, remote: str | None = None, headers: Mapping[str, str] | None = None
    ) -> Answer:
        """Answer one request body; ``headers`` are the HTTP request's (its trace context)."""
        started = time.perf_counter()
        try:
            review = decode_review(body)
        except BadReview as exc:
            return self.bad_request(exc.reason, str(exc), remote=remote)

        identity = pod_identity(review)
        parent, links = self._parent_context(review, headers)
        tel = self.telemetry
        with tel.tracer.start_as_current_span(
            "webhook.admission",
            context=parent,
            links=links,
            kind=SpanKind.SERVER,
            attributes={
                "k8s.namespace.name": identity["namespace"],
                "k8s.pod.name": identity["name"],
                "hamipy.admission.uid": review.uid,
                "hamipy.admission.operation": review.request.operation or "",
            },
        ) as span:
            try:
                decision = self._decide(review, traceparent_of(span))
            except Exception as exc:
                # Fail closed: a GPU pod must not slip past unmutated because of a bug here.
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, "admission failed"))
                tel.metrics.admissions.labels(outcome="error", reason="exception").inc()
                tel.logger.exception("admission failed", **identity)
                doc = encode_response(
                    review, allowed=False, code=500, message=f"hami-py webhook internal error: {exc!r}"
                )
                tel.metrics.admission_seconds.labels(outcome="error").observe(time.perf_counter() - started)
                return Answer(200, _dump(doc))
            span.set_attribute("hamipy.admission.outcome", decision.outcome)
            span.set_attribute("hamipy.admission.reason", decision.reason)
            doc = encode_response(
                review,
                allowed=decision.allowed,
                patch=decision.patch,
                message=decision.message,
            )
            elapsed = time.perf_counter() - started
            tel.metrics.admissions.labels(outcome=decision.outcome, reason=decision.reason).inc()
            tel.metrics.admission_seconds.labels(outcome=decision.outcome).observe(elapsed)
            fields: dict[str, Any] = {
                **identity,
                "outcome": decision.outcome,
                "reason": decision.reason,
                "patch_ops": len(decision.patch),
                "duration_ms": round(elapsed * 1000, 3),
            }
            # Inside the span, so the line carries its trace and span ids.
            if decision.outcome == "refused":
                tel.logger.warning("pod refused", message=decision.message, **fields)
            else:
                tel.logger.info("pod admitted", **fields)
        return Answer(200, _dump(doc), decision)

    @staticmethod
    def _parent_context(
        review: Review, headers: Mapping[str, str] | None
    ) -> tuple[otel_context.Context | None, list[Link]]:
        """The admission span's parent and links: the pod's own trace (annotation
        ``keys.TRACE_CONTEXT``, set by whoever made the pod) when it has one, else the API server's
        request trace (its ``traceparent`` header); the one not chosen is linked."""
        annotations = review.pod.metadata.annotations if review.pod is not None else None
        from_pod = traceparent_context((annotations or {}).get(keys.TRACE_CONTEXT))
        from_caller = incoming_context(headers) if headers else None
        parent = from_pod or from_caller
        other = from_caller if from_pod is not None else None
        links = [Link(trace.get_current_span(other).get_span_context())] if other is not None else []
        return parent, links

    def _decide(self, review: Review, traceparent: str | None) -> Decision:
        if not review.is_pod:
            return Decision("allowed", "not_pod")
        pod = review.pod
        if (review.request.operation or "CREATE") != "CREATE" or pod is None:
            return Decision("allowed", "not_create")
        return decide(plain(pod), self.settings, trace_context=traceparent)
