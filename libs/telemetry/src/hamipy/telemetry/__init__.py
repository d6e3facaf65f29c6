"""Logging and tracing set-up shared by every hami-py service (DESIGN.md decision 8).

- ``make_logger``: structlog JSON lines carrying the service name; callers bind namespace/pod/uid.
- ``make_tracer_provider``: a provider of our own (not the process-global one) whose spans always
  have real ids, exporting over OTLP/HTTP only when the standard ``OTEL_*`` variables ask for it.
- ``pod_trace_context`` / ``traceparent_of``: one trace per pod. The webhook starts it and records
  the W3C ``traceparent`` in the pod annotation ``hami-py.io/traceparent``; the extender and the
  device plugin continue it from there.

Metrics stay in each service: their names and labels are the service's own contract. Submodules:
``service`` (``ServiceTelemetry``: one service's logger, metrics and tracer together) and ``probes``
(the node agents' ``/metrics``, ``/healthz``, ``/readyz`` server).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import structlog
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from hamipy.protocol import keys

__all__ = [
    "make_logger",
    "make_tracer_provider",
    "otlp_export_wanted",
    "pod_trace_context",
    "traceparent_of",
]

_PROPAGATOR = TraceContextTextMapPropagator()


def make_logger(
    service: str, stream: TextIO | None = None, *, level: int = logging.INFO
) -> structlog.typing.FilteringBoundLogger:
    """A JSON-lines logger writing to ``stream`` (stdout by default), carrying ``service``."""
    logger: structlog.typing.FilteringBoundLogger = structlog.wrap_logger(
        structlog.WriteLogger(stream if stream is not None else sys.stdout),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=True,
    )
    return logger.bind(service=service)


def otlp_export_wanted(env: Mapping[str, str]) -> bool:
    """Whether the standard variables ask for OTLP trace export.

    ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` say no; an ``OTEL_TRACES_EXPORTER``
    list naming ``otlp`` says yes; otherwise an OTLP endpoint being set says yes.
    """
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return "otlp" in {e.strip() for e in exporters.split(",")}
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _headers(text: str) -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_HEADERS``: ``key=value`` pairs separated by commas."""
    pairs = (item.split("=", 1) for item in text.split(",") if "=" in item)
    return {key.strip(): value.strip() for key, value in pairs}


def _otlp_processor(env: Mapping[str, str]) -> SpanProcessor:
    """A batch processor with the OTLP/HTTP exporter, configured from ``env`` (not only from
    ``os.environ``, which the exporter would read by itself: a service handed another mapping, as
    tests do, must export where that mapping says)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").rstrip("/")
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or (f"{base}/v1/traces" if base else None)
    headers = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS")
    exporter = OTLPSpanExporter(endpoint=endpoint, headers=_headers(headers) if headers else None)
    delay = env.get("OTEL_BSP_SCHEDULE_DELAY")
    return BatchSpanProcessor(exporter, schedule_delay_millis=float(delay) if delay else None)


def make_tracer_provider(
    service: str, env: Mapping[str, str], *, processor: SpanProcessor | None = None
) -> TracerProvider:
    """Our tracer provider: the OTLP/HTTP exporter when ``env`` asks for it (endpoint, headers and
    batch delay from ``env``'s ``OTEL_*`` variables; other exporter settings such as the timeout,
    10 s by default, from the process environment), plus ``processor`` (tests pass an in-memory
    one)."""
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource)
    if otlp_export_wanted(env):
        provider.add_span_processor(_otlp_processor(env))
    if processor is not None:
        provider.add_span_processor(processor)
    return provider


def pod_trace_context(pod: Mapping[str, Any]) -> Context | None:
    """The trace context recorded in a pod's annotations, or None when there is none (or it is not
    a valid W3C traceparent: then the caller starts a fresh trace rather than failing the pod)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(keys.TRACE_CONTEXT)
    if not isinstance(value, str) or not value:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": value})
    from opentelemetry import trace

    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_of(span: Span) -> str:
    """The W3C ``traceparent`` value naming ``span``, for the pod annotation."""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier["traceparent"]
