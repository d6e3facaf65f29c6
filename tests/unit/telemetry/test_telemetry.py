"""hamipy.telemetry: logs with trace ids and without locals, tracing by the SDK's rules from the
standard ``OTEL_*`` variables (exporters over OTLP/HTTP and OTLP/gRPC, resource, sampler,
disabling), and the pod trace-context carry."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hamipy.protocol import keys
from hamipy.telemetry import (
    TracingConfigError,
    exporter_names,
    incoming_context,
    make_logger,
    make_tracer_provider,
    pod_trace_context,
    traceparent_of,
)

SAMPLE_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# -- which exporters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "names"),
    [
        pytest.param({}, [], id="nothing-set"),
        pytest.param({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp_proto_http"], id="endpoint"),
        pytest.param(
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"},
            ["otlp_proto_http"],
            id="traces-endpoint",
        ),
        pytest.param({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp_proto_http"], id="exporter-otlp"),
        pytest.param(
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            ["otlp_proto_grpc"],
            id="grpc",
        ),
        pytest.param(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
            ["otlp_proto_grpc"],
            id="traces-protocol",
        ),
        pytest.param(
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            ["otlp_proto_http"],
            id="traces-protocol-wins",
        ),
        pytest.param(
            {"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp_proto_http"], id="exporter-list"
        ),
        pytest.param(
            {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, [], id="none"
        ),
        pytest.param({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, [], id="sdk-disabled"),
        pytest.param(
            {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, ["otlp_proto_http"], id="sdk-on"
        ),
    ],
)
def test_exporters_follow_the_standard_variables(env: dict[str, str], names: list[str]) -> None:
    assert exporter_names(env) == names


def test_an_unknown_protocol_is_refused_by_name() -> None:
    with pytest.raises(TracingConfigError, match="thrift"):
        exporter_names({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})


def test_an_exporter_that_is_not_installed_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(TracingConfigError, match="zipkin"):
        make_tracer_provider("hamipy-test")


# -- the provider: resource, sampler, disabling ----------------------------------------------------------


def recording(service: str = "hamipy-test") -> tuple[InMemorySpanExporter, object]:
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(service, processor=SimpleSpanProcessor(exporter))
    return exporter, provider


def test_service_name_defaults_to_ours() -> None:
    provider = make_tracer_provider("hamipy-test")
    assert provider.resource.attributes["service.name"] == "hamipy-test"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        pytest.param("OTEL_SERVICE_NAME", "gpu-webhook", id="service-name"),
        pytest.param(
            "OTEL_RESOURCE_ATTRIBUTES", "service.name=gpu-webhook,deployment.environment=prod", id="attrs"
        ),
    ],
)
def test_the_fleets_service_name_wins_over_ours(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    provider = make_tracer_provider("hamipy-test")
    assert provider.resource.attributes["service.name"] == "gpu-webhook"


def test_resource_attributes_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,k8s.cluster.name=gpu%20one")
    attributes = make_tracer_provider("hamipy-test").resource.attributes
    assert attributes["deployment.environment"] == "prod"
    assert attributes["k8s.cluster.name"] == "gpu one"
    assert attributes["service.name"] == "hamipy-test"


def test_the_sampler_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider("hamipy-test", processor=SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("admission") as span:
        value = traceparent_of(span)
    assert exporter.get_finished_spans() == ()
    # Not sampled, but still a context: downstream services make the same decision.
    assert value is not None
    assert int(value.rsplit("-", 1)[1], 16) & 0x01 == 0, "the sampled flag is off"


def test_sdk_disabled_makes_no_span_and_no_traceparent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider("hamipy-test", processor=SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("admission") as span:
        assert traceparent_of(span) is None
    assert exporter.get_finished_spans() == ()


# -- logs ------------------------------------------------------------------------------------------------


def test_logger_writes_json_lines_with_service_and_bound_fields() -> None:
    out = io.StringIO()
    make_logger("hamipy-test", out).bind(namespace="ns", pod="p").info("hello", uid="u1")
    line = json.loads(out.getvalue())
    assert line["service"] == "hamipy-test"
    assert (line["namespace"], line["pod"], line["uid"], line["event"]) == ("ns", "p", "u1", "hello")
    assert line["level"] == "info"
    assert "trace_id" not in line


def test_a_line_logged_in_a_span_carries_its_ids() -> None:
    out = io.StringIO()
    logger = make_logger("hamipy-test", out)
    provider = make_tracer_provider("hamipy-test")
    with provider.get_tracer("t").start_as_current_span("admission") as span:
        logger.info("inside")
    logger.info("after")
    inside, after = (json.loads(line) for line in out.getvalue().splitlines())
    context = span.get_span_context()
    assert (inside["trace_id"], inside["span_id"]) == (f"{context.trace_id:032x}", f"{context.span_id:016x}")
    assert "trace_id" not in after


@pytest.mark.parametrize("record_unexported", [True, False])
def test_unexported_spans_are_recorded_unless_the_service_says_not(record_unexported: bool) -> None:
    out = io.StringIO()
    logger = make_logger("hamipy-test", out)
    provider = make_tracer_provider("hamipy-test", record_unexported=record_unexported)
    parent = pod_trace_context({"metadata": {"annotations": {keys.TRACE_CONTEXT: SAMPLE_TRACEPARENT}}})
    with provider.get_tracer("t").start_as_current_span("bind", context=parent) as span:
        span.set_attribute("k8s.pod.name", "p")
        logger.info("inside")
    # The SDK's recording span, or a NonRecordingSpan that kept nothing.
    assert isinstance(span, trace.NonRecordingSpan) is not record_unexported
    context = span.get_span_context()
    assert f"{context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"  # the pod's trace goes on
    assert context.span_id not in (0, 0xB7AD6B7169203331)  # a span id of its own, as before
    line = json.loads(out.getvalue())
    assert (line["trace_id"], line["span_id"]) == (f"{context.trace_id:032x}", f"{context.span_id:016x}")


def test_spans_that_go_somewhere_are_recorded_whatever_the_service_says() -> None:
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(
        "hamipy-test", processor=SimpleSpanProcessor(exporter), record_unexported=False
    )
    with provider.get_tracer("t").start_as_current_span("bind") as span:
        span.set_attribute("k8s.pod.name", "p")
    [finished] = exporter.get_finished_spans()
    assert finished.attributes == {"k8s.pod.name": "p"}


def test_an_exporter_from_the_environment_records_spans_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    provider = make_tracer_provider("hamipy-test", record_unexported=False)
    span = provider.get_tracer("t").start_span("bind")
    assert span.is_recording()
    provider.shutdown()


def test_an_exception_is_logged_without_local_variables() -> None:
    out = io.StringIO()
    logger = make_logger("hamipy-test", out)

    def handle(body: bytes) -> None:
        token = body.split(b"=", 1)[1].decode()
        raise ValueError(f"bad token of length {len(token)}")

    try:
        handle(b"token=hunter2-is-a-secret")
    except ValueError:
        logger.exception("request failed")
    line = json.loads(out.getvalue())
    assert line["exception"][0]["exc_type"] == "ValueError"
    assert line["exception"][0]["frames"], "the frames are still there"
    assert "hunter2" not in out.getvalue()


# -- the pod's trace -------------------------------------------------------------------------------------


def test_trace_continues_from_the_pod_annotation() -> None:
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider("hamipy-test", processor=SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("admission") as root:
        value = traceparent_of(root)
    assert value is not None
    pod = {"metadata": {"annotations": {keys.TRACE_CONTEXT: value}}}
    with tracer.start_as_current_span("filter", context=pod_trace_context(pod)):
        pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["filter"].context.trace_id == spans["admission"].context.trace_id
    assert spans["filter"].parent is not None
    assert spans["filter"].parent.span_id == spans["admission"].context.span_id


def test_known_traceparent_is_extracted() -> None:
    ctx = pod_trace_context({"metadata": {"annotations": {keys.TRACE_CONTEXT: SAMPLE_TRACEPARENT}}})
    assert ctx is not None


@pytest.mark.parametrize(
    "pod",
    [
        pytest.param({}, id="no-metadata"),
        pytest.param({"metadata": {}}, id="no-annotations"),
        pytest.param({"metadata": "x"}, id="metadata-not-an-object"),
        pytest.param({"metadata": {"annotations": ["x"]}}, id="annotations-not-an-object"),
        pytest.param({"metadata": {"annotations": {keys.TRACE_CONTEXT: ""}}}, id="empty"),
        pytest.param({"metadata": {"annotations": {keys.TRACE_CONTEXT: "garbage"}}}, id="garbage"),
        pytest.param({"metadata": {"annotations": {keys.TRACE_CONTEXT: 7}}}, id="not-a-string"),
    ],
)
def test_missing_or_invalid_context_starts_a_fresh_trace(pod: dict[str, object]) -> None:
    assert pod_trace_context(pod) is None


def test_an_incoming_traceparent_header_is_read() -> None:
    assert incoming_context({"traceparent": SAMPLE_TRACEPARENT}) is not None
    assert incoming_context({"traceparent": "00-garbage"}) is None
    assert incoming_context({}) is None


# -- export, as configured by the variables --------------------------------------------------------------


@pytest.fixture
async def otlp_http() -> AsyncIterator[tuple[str, list[dict[str, str]], asyncio.Event]]:
    received: list[dict[str, str]] = []
    arrived = asyncio.Event()

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        received.append({"path": request.path, **{k.lower(): v for k, v in request.headers.items()}})
        arrived.set()
        return web.Response(content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", received, arrived
    await runner.cleanup()


async def export_one(service: str) -> None:
    provider = make_tracer_provider(service)
    try:
        with provider.get_tracer("t").start_as_current_span("one"):
            pass
    finally:
        await asyncio.to_thread(provider.shutdown)  # flushes the batch


async def test_otlp_http_export_with_url_decoded_headers(
    monkeypatch: pytest.MonkeyPatch, otlp_http: tuple[str, list[dict[str, str]], asyncio.Event]
) -> None:
    url, received, arrived = otlp_http
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url + "/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Basic%20dXNlcjpwdw==, x-team=gpu")
    await export_one("hamipy-test")
    async with asyncio.timeout(10):
        await arrived.wait()
    assert received[0]["path"] == "/v1/traces"
    assert received[0]["authorization"] == "Basic dXNlcjpwdw=="
    assert received[0]["x-team"] == "gpu"


async def test_the_batch_delay_variable_sends_without_a_flush(
    monkeypatch: pytest.MonkeyPatch, otlp_http: tuple[str, list[dict[str, str]], asyncio.Event]
) -> None:
    url, _, arrived = otlp_http
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url + "/v1/traces")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    provider = make_tracer_provider("hamipy-test")
    try:
        with provider.get_tracer("t").start_as_current_span("one"):
            pass
        async with asyncio.timeout(10):
            await arrived.wait()  # 50 ms, not the default 5 s: no shutdown needed to see it
    finally:
        await asyncio.to_thread(provider.shutdown)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str | bytes], trace_service_pb2.ExportTraceServiceRequest]] = []
        self.arrived = asyncio.Event()

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[
            trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse
        ],
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.append((dict(list(context.invocation_metadata() or ())), request))
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_otlp_grpc_export(monkeypatch: pytest.MonkeyPatch) -> None:
    service = _TraceService()
    server = grpc.aio.server()
    # opentelemetry-proto's generated gRPC module has no annotations
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=gpu%20ops")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "gpu-extender")
        await export_one("hamipy-test")
        async with asyncio.timeout(10):
            await service.arrived.wait()
    finally:
        await server.stop(grace=None)
    metadata, request = service.received[0]
    assert metadata["x-team"] == "gpu ops"
    [resource_spans] = request.resource_spans
    names = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert names["service.name"] == "gpu-extender"
    assert [s.name for s in resource_spans.scope_spans[0].spans] == ["one"]
