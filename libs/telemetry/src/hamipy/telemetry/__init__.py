"""Logging and tracing set-up shared by every hami-py service (docs/operations.md).

- ``make_logger`` (``logs``): structlog JSON lines carrying the service name and, inside a span,
  ``trace_id``/``span_id``; exceptions without the frames' local variables.
- ``make_tracer_provider`` (``tracing``): a provider of our own (not the process-global one)
  configured by the OpenTelemetry SDK from the standard ``OTEL_*`` variables, with our defaults only
  where they are unset.
- ``pod_trace_context`` / ``traceparent_context`` / ``traceparent_of`` / ``incoming_context``: one
  trace per pod. The webhook starts it (continuing the API server's ``traceparent`` when it sends
  one) and records the W3C ``traceparent`` in the pod annotation ``hami-py.io/traceparent``; the
  extender and the device plugin continue it from there.

Metrics stay in each service: their names and labels are the service's own contract. Other
submodules: ``service`` (``ServiceTelemetry``: one service's logger, metrics and tracer together),
``exposition`` (gauge families written straight to Prometheus text) and ``gc_pauses`` (the garbage
collector's pauses as a histogram). Serving HTTP and keeping the process up live
in ``hamipy.serving``.
"""

from __future__ import annotations

from hamipy.telemetry.logs import add_trace_ids, make_logger
from hamipy.telemetry.tracing import (
    TracingConfigError,
    exporter_names,
    incoming_context,
    make_tracer_provider,
    pod_trace_context,
    traceparent_context,
    traceparent_of,
)

__all__ = [
    "TracingConfigError",
    "add_trace_ids",
    "exporter_names",
    "incoming_context",
    "make_logger",
    "make_tracer_provider",
    "pod_trace_context",
    "traceparent_context",
    "traceparent_of",
]
