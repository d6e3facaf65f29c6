"""hamipy.telemetry: the shared logger, OTLP switch and the pod trace-context carry."""

from __future__ import annotations

import io
import json

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hamipy.protocol import keys
from hamipy.telemetry import (
    make_logger,
    make_tracer_provider,
    otlp_export_wanted,
    pod_trace_context,
    traceparent_of,
)

SAMPLE_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        pytest.param({}, False, id="nothing-set"),
        pytest.param({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True, id="endpoint"),
        pytest.param(
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True, id="traces-endpoint"
        ),
        pytest.param({"OTEL_TRACES_EXPORTER": "otlp"}, True, id="exporter-otlp"),
        pytest.param({"OTEL_TRACES_EXPORTER": "console,otlp"}, True, id="exporter-list"),
        pytest.param(
            {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False, id="none"
        ),
        pytest.param({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False, id="sdk-disabled"),
    ],
)
def test_otlp_export_follows_standard_variables(env: dict[str, str], wanted: bool) -> None:
    assert otlp_export_wanted(env) is wanted


def test_logger_writes_json_lines_with_service_and_bound_fields() -> None:
    out = io.StringIO()
    make_logger("hamipy-test", out).bind(namespace="ns", pod="p").info("hello", uid="u1")
    line = json.loads(out.getvalue())
    assert line["service"] == "hamipy-test"
    assert (line["namespace"], line["pod"], line["uid"], line["event"]) == ("ns", "p", "u1", "hello")
    assert line["level"] == "info"


def test_trace_continues_from_the_pod_annotation() -> None:
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider("hamipy-test", {}, processor=SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("admission") as root:
        value = traceparent_of(root)
    pod = {"metadata": {"annotations": {keys.TRACE_CONTEXT: value}}}
    with tracer.start_as_current_span("filter", context=pod_trace_context(pod)):
        pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["filter"].context.trace_id == spans["admission"].context.trace_id
    assert spans["filter"].parent is not None
    assert spans["filter"].parent.span_id == spans["admission"].context.span_id
    assert provider.resource.attributes["service.name"] == "hamipy-test"


def test_known_traceparent_is_extracted() -> None:
    ctx = pod_trace_context({"metadata": {"annotations": {keys.TRACE_CONTEXT: SAMPLE_TRACEPARENT}}})
    assert ctx is not None


@pytest.mark.parametrize(
    "pod",
    [
        pytest.param({}, id="no-metadata"),
        pytest.param({"metadata": {}}, id="no-annotations"),
        pytest.param({"metadata": {"annotations": {keys.TRACE_CONTEXT: ""}}}, id="empty"),
        pytest.param({"metadata": {"annotations": {keys.TRACE_CONTEXT: "garbage"}}}, id="garbage"),
        pytest.param({"metadata": {"annotations": {keys.TRACE_CONTEXT: 7}}}, id="not-a-string"),
    ],
)
def test_missing_or_invalid_context_starts_a_fresh_trace(pod: dict[str, object]) -> None:
    assert pod_trace_context(pod) is None
