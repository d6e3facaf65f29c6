"""A small OTLP/HTTP trace receiver: where the services' spans go in tests and under ``make up``.

``POST /v1/traces`` with an ``ExportTraceServiceRequest`` protobuf (gzip or not), as the standard
OTLP/HTTP exporter sends it. Every span is kept (``spans``, ``trace(trace_id)``) and, when a file
is given, appended to it as one JSON line, so ``hamipy-devcluster trace`` can show a pod's journey
after the fact. Not a collector: no retries, no batching, no other signals.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["OtlpReceiver", "ReceivedSpan", "load_spans"]


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def load_spans(path: Path) -> list[ReceivedSpan]:
    """The spans an ``OtlpReceiver`` wrote to ``path`` (JSON lines)."""
    if not path.is_file():
        return []
    return [ReceivedSpan(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


class OtlpReceiver:
    """OTLP/HTTP ``POST /v1/traces`` on a loopback port (``url`` once started)."""

    def __init__(self, *, record: Path | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.record = record
        self.host = host
        self.port = port
        self.spans: list[ReceivedSpan] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans of one trace, by start time."""
        return sorted((s for s in self.spans if s.trace_id == trace_id), key=lambda s: s.start_ns)

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            if request.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            export = ExportTraceServiceRequest.FromString(body)
        except (OSError, ValueError) as exc:  # DecodeError is a ValueError
            return web.Response(status=400, text=f"not an OTLP trace export: {exc}")
        received = []
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        self.spans.extend(received)
        if self.record is not None and received:
            with self.record.open("a") as out:
                for got in received:
                    out.write(json.dumps(dataclasses.asdict(got)) + "\n")
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
