"""Logs, metrics and traces of the webhook, with no module-level state
(docs/design.md#8-observable-by-default).

- Logs: structlog JSON lines (``hamipy.telemetry``), each admission line carrying namespace/name/uid.
- Metrics: a per-server ``CollectorRegistry`` (so tests and several servers in one process do not
  share counters): the admission latency histogram, admissions by outcome and reason, bad requests
  by reason, certificate reloads.
- Traces: a ``TracerProvider`` of our own from ``hamipy.telemetry`` (real trace ids whether or not
  anything exports; OTLP/HTTP only when the standard ``OTEL_*`` variables ask for it).
"""

from __future__ import annotations

import typing
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from hamipy.serving.http_metrics import HttpConnectionsCollector
from hamipy.telemetry.service import ServiceTelemetry
from hamipy.webhook.errors import BadReviewReason

__all__ = [
    "SERVICE_NAME",
    "Metrics",
    "Telemetry",
]

SERVICE_NAME: Final = "hamipy-webhook"

# Admission is pure CPU work of well under a millisecond; the buckets resolve the 5 ms target and
# still show the apiserver's own timeout region (seconds) if the loop were ever blocked.
_LATENCY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.5,
    1.0,
    5.0,
)


class Metrics:
    """The webhook's Prometheus metrics, on their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.admission_seconds = Histogram(
            "hamipy_webhook_admission_duration_seconds",
            "Time to answer one AdmissionReview, from the full body to the encoded answer.",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.admissions = Counter(
            "hamipy_webhook_admissions",
            "AdmissionReviews answered, by outcome (mutated, allowed, refused, error) and reason.",
            ["outcome", "reason"],
            registry=self.registry,
        )
        self.bad_requests = Counter(
            "hamipy_webhook_bad_requests",
            "Requests answered with HTTP 400 because they were not an AdmissionReview we can answer.",
            ["reason"],
            registry=self.registry,
        )
        self.certificate_reloads = Counter(
            "hamipy_webhook_certificate_reloads",
            "Serving certificate reloads after the files changed, by result (ok, failed).",
            ["result"],
            registry=self.registry,
        )
        self.connections = HttpConnectionsCollector("hamipy_webhook")
        """What the HTTP limits did on each port (``api``: TLS, ``probes``: the metrics port)."""
        self.registry.register(self.connections)

        # Known label values start at zero: a series that appears only at its first event hides
        # that event from rate() and increase() (an alert on the first bad request would miss it).
        for reason in (*typing.get_args(BadReviewReason), "too_large"):
            self.bad_requests.labels(reason=reason)
        self.admissions.labels(outcome="error", reason="exception")
        for outcome in ("mutated", "allowed", "refused", "error"):
            self.admission_seconds.labels(outcome=outcome)
        for result in ("ok", "failed"):
            self.certificate_reloads.labels(result=result)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)


class Telemetry(ServiceTelemetry[Metrics]):
    """What the admission path reports through: logger, metrics and tracer."""

    SERVICE = SERVICE_NAME
    TRACER_NAME = "hamipy.webhook"

    @classmethod
    def new_metrics(cls) -> Metrics:
        return Metrics()
