"""Tracing by the OpenTelemetry SDK's own rules, and the one-trace-per-pod context carry.

Every standard variable is read by the SDK itself from the process environment, so a fleet's
settings mean here what they mean in any OpenTelemetry service: ``OTEL_SDK_DISABLED`` (no spans),
``OTEL_TRACES_SAMPLER``/``_ARG``, ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (they win
over our service name), ``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP[_TRACES]_{ENDPOINT,HEADERS,
PROTOCOL,TIMEOUT,COMPRESSION,CERTIFICATE,...}``, ``OTEL_BSP_*`` and ``OTEL_PROPAGATORS``. Our
defaults apply only where a variable is unset:

- ``OTEL_TRACES_EXPORTER`` unset: ``otlp`` when an OTLP endpoint variable is set, else nothing is
  exported (the SDK would export to localhost:4317 and log a connection error per batch);
- ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` unset: ``http/protobuf`` (the specification's default;
  the Python SDK's own is gRPC);
- ``service.name``: the service's name.

The provider is the service's own, never the process-global one, so several services can run in
one test process. The pod's trace: the webhook records the W3C ``traceparent`` of its admission
span in the pod annotation ``hami-py.io/traceparent`` (``traceparent_of``); the extender and the
device plugin continue it (``pod_trace_context``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any, Final

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from hamipy.protocol import keys

__all__ = [
    "TracingConfigError",
    "exporter_names",
    "incoming_context",
    "make_tracer_provider",
    "pod_trace_context",
    "traceparent_context",
    "traceparent_of",
]

_EXPORTER_GROUP: Final = "opentelemetry_traces_exporter"
_OTLP_BY_PROTOCOL: Final = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
_DEFAULT_PROTOCOL: Final = "http/protobuf"
# The pod annotation always holds W3C trace context, whatever OTEL_PROPAGATORS says for HTTP.
_POD_PROPAGATOR: Final = TraceContextTextMapPropagator()


class TracingConfigError(ValueError):
    """The ``OTEL_*`` variables name an exporter or protocol that does not exist."""


def _sdk_disabled(env: Mapping[str, str]) -> bool:
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def exporter_names(env: Mapping[str, str]) -> list[str]:
    """The span exporters' entry-point names (``opentelemetry_traces_exporter``) ``env`` asks for:
    ``otlp`` resolved to ``otlp_proto_http`` or ``otlp_proto_grpc`` by the protocol variables."""
    if _sdk_disabled(env):
        return []
    listed = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not listed:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        listed = "otlp" if endpoint else "none"
    names = [name.strip() for name in listed.split(",") if name.strip()]
    if names == ["none"]:
        return []
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip() or _DEFAULT_PROTOCOL
    resolved = []
    for name in names:
        if name == "otlp":
            if protocol not in _OTLP_BY_PROTOCOL:
                raise TracingConfigError(
                    f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: supported are {sorted(_OTLP_BY_PROTOCOL)}"
                )
            name = _OTLP_BY_PROTOCOL[protocol]
        if name != "none":
            resolved.append(name)
    return resolved


def _exporters(names: list[str]) -> Iterator[SpanExporter]:
    """Each exporter made with no arguments: it reads its own ``OTEL_EXPORTER_*`` variables."""
    for name in names:
        found = list(entry_points(group=_EXPORTER_GROUP, name=name))
        if not found:
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER names {name!r}, which is not installed")
        exporter = found[0].load()()
        if not isinstance(exporter, SpanExporter):
            raise TracingConfigError(f"{name!r} is not a span exporter")
        yield exporter


def make_tracer_provider(
    service: str, *, processor: SpanProcessor | None = None, record_unexported: bool = True
) -> TracerProvider:
    """The service's tracer provider, configured by the SDK from the process environment (sampler,
    disabling, resource, exporters, batching), plus ``processor`` (tests pass an in-memory one).

    ``record_unexported=False``: when no exporter and no ``processor`` receive spans, spans are not
    recorded at all (sampler ``always_off``). They still carry their trace id (the parent's, else a
    new one) and a span id, so log lines keep both; only a service that writes no trace context
    downstream may ask for it, since its trace flags then read "not sampled". The extender does:
    recording spans that nothing exports would cost CPU on the path every ``/filter`` waits on.

    Raises ``TracingConfigError`` for an exporter or protocol that does not exist.
    """
    resource = Resource.create({SERVICE_NAME: service}).merge(OTELResourceDetector().detect())
    exporters = list(_exporters(exporter_names(os.environ)))
    unexported = not exporters and processor is None
    provider = TracerProvider(
        resource=resource, sampler=ALWAYS_OFF if unexported and not record_unexported else None
    )
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if processor is not None:
        provider.add_span_processor(processor)
    return provider


def incoming_context(headers: Mapping[str, str]) -> Context | None:
    """The trace context an HTTP caller sent (``traceparent``; other formats as ``OTEL_PROPAGATORS``
    configures the global propagator), or None when it sent none that is valid."""
    context = propagate.extract(headers)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def pod_trace_context(pod: Mapping[str, Any]) -> Context | None:
    """The trace context recorded in a pod's annotations, or None when there is none (or it is not
    a valid W3C traceparent: then the caller starts a fresh trace rather than failing the pod)."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    value = annotations.get(keys.TRACE_CONTEXT) if isinstance(annotations, Mapping) else None
    return traceparent_context(value if isinstance(value, str) else None)


def traceparent_context(traceparent: str | None) -> Context | None:
    """The trace context a W3C ``traceparent`` names (a pod annotation's value), or None when it
    names none that is valid."""
    if not traceparent:
        return None
    context = _POD_PROPAGATOR.extract({"traceparent": traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def traceparent_of(span: Span) -> str | None:
    """The W3C ``traceparent`` naming ``span``, for the pod annotation; None when the span has no
    valid context (tracing disabled and no parent: there is no trace to continue)."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _POD_PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")
