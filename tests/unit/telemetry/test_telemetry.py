"""hamipy.telemetry: the shared logger, OTLP switch and the pod trace-context carry."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from aiohttp import web
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


async def test_otlp_export_goes_where_the_given_env_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not os.environ: the endpoint, headers and batch delay come from the mapping handed over."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    received: list[tuple[str, str]] = []
    arrived = asyncio.Event()

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        received.append((request.path, request.headers.get("x-team", "")))
        arrived.set()
        return web.Response(content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{runner.addresses[0][1]}/",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-team=gpu, x-token=abc",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    provider = make_tracer_provider("hamipy-test", env)
    try:
        with provider.get_tracer("t").start_as_current_span("one"):
            pass
        async with asyncio.timeout(10):
            await arrived.wait()  # the batch delay alone (50 ms) sends it, no flush
    finally:
        await asyncio.to_thread(provider.shutdown)
        await runner.cleanup()
    assert received[0] == ("/v1/traces", "gpu")
