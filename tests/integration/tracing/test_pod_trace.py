"""One trace per pod (issue 10): the webhook's admission span, the extender's filter and bind spans
and the device plugin's Allocate span arrive at an OTLP receiver as one trace, in that order, the
later ones children of the admission span (whose context the webhook left in the pod annotation).

Every service exports with the standard ``OTEL_*`` variables only: the webhook and extender in this
process, the device plugin as its own process. The receiver is a small OTLP/HTTP endpoint here that
decodes ``ExportTraceServiceRequest`` protobufs.
"""

from __future__ import annotations

import dataclasses
import gzip
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from stack_support import GpuStack, gpu_container, running_gpu_stack

from hamipy.devcluster import DevCluster, NodePool, wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.protocol import keys

pytestmark = pytest.mark.integration

GPUS = (FakeGpu("GPU-cccccccc-0000-4000-8000-000000000000", "NVIDIA H100 80GB HBM3", 81559),)
JOURNEY = ["webhook.admission", "extender.filter", "extender.bind", "device_plugin.allocate"]


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    attributes: dict[str, Any]


class OtlpReceiver:
    """OTLP/HTTP ``POST /v1/traces`` (protobuf) collecting every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attributes = {a.key: _value(a.value) for a in span.attributes}
                    self.spans.append(
                        ReceivedSpan(
                            service=resource.get("service.name", ""),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            attributes=attributes,
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return sorted((s for s in self.spans if s.trace_id == trace_id), key=lambda s: s.start_ns)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    otlp = OtlpReceiver()
    await otlp.start()
    yield otlp
    await otlp.stop()


@pytest.fixture
async def traced_stack(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    node_pool: NodePool,
    hami_scheduler: Callable[..., Any],
    receiver: OtlpReceiver,
) -> AsyncIterator[GpuStack]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s, not the default 5 s
    }
    async with running_gpu_stack(
        devcluster, kube_client, namespace, node_pool, hami_scheduler, gpus=GPUS, env=env
    ) as stack:
        yield stack


async def test_one_pod_one_trace_from_admission_to_allocate(
    traced_stack: GpuStack, receiver: OtlpReceiver
) -> None:
    stack = traced_stack
    await stack.create(stack.pod_body("traced", [gpu_container("main", mem=2000, cores=20)]))
    pod = await stack.served("traced")
    meta = pod["metadata"]
    # 00-<trace id>-<admission span id>-<flags>
    _, trace_id, admission_id, _ = meta["annotations"][keys.TRACE_CONTEXT].split("-")

    def journey() -> list[ReceivedSpan] | None:
        spans = receiver.trace(trace_id)
        return spans if [s.name for s in spans] == JOURNEY else None

    spans = await wait_for(journey, timeout=30, interval=0.1, what=f"the spans {JOURNEY} of trace {trace_id}")
    admission, filtering, binding, allocate = spans
    assert admission.span_id == admission_id
    assert [s.service for s in spans] == [
        "hamipy-webhook",
        "hamipy-extender",
        "hamipy-extender",
        "hamipy-device-plugin",
    ]
    for span in (filtering, binding, allocate):
        assert span.parent_id == admission.span_id, f"{span.name} is not a child of the admission span"
        assert span.attributes["k8s.pod.uid"] == meta["uid"]
    for span in spans:
        assert span.attributes["k8s.namespace.name"] == stack.namespace
        assert span.attributes["k8s.pod.name"] == "traced"
    assert allocate.attributes["k8s.container.name"] == "main"
    assert binding.attributes["k8s.node.name"] == stack.node
