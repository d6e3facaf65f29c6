"""One service's logger, metrics and tracer together: what the request paths report through.

Each service subclasses ``ServiceTelemetry`` with its name, its tracer's name and its metrics (their
names and labels are the service's contract); ``create`` makes all three the normal way (JSON logs;
spans as the ``OTEL_*`` variables of the process environment say, read by the SDK).
"""

from __future__ import annotations

import logging
from typing import ClassVar, Generic, Self, TextIO, TypeVar

import structlog
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import Tracer

from hamipy.telemetry import make_logger, make_tracer_provider

__all__ = ["ServiceTelemetry"]

MetricsT = TypeVar("MetricsT")


class ServiceTelemetry(Generic[MetricsT]):
    """Logger, metrics and tracer of one service instance (no module-level state)."""

    SERVICE: ClassVar[str]
    """The service's name in logs and traces, e.g. ``hamipy-extender``."""
    TRACER_NAME: ClassVar[str]
    """The instrumentation scope of the service's spans, e.g. ``hamipy.extender``."""
    RECORD_UNEXPORTED: ClassVar[bool] = True
    """Record spans even when nothing exports them (``make_tracer_provider``'s ``record_unexported``)."""

    def __init__(
        self,
        *,
        logger: structlog.typing.FilteringBoundLogger,
        metrics: MetricsT,
        tracer_provider: TracerProvider,
    ) -> None:
        self.logger = logger
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        self.tracer: Tracer = tracer_provider.get_tracer(self.TRACER_NAME)

    @classmethod
    def new_metrics(cls) -> MetricsT:
        """The service's metrics, on a registry of their own."""
        raise NotImplementedError

    @classmethod
    def create(
        cls,
        *,
        stream: TextIO | None = None,
        level: int = logging.INFO,
        processor: SpanProcessor | None = None,
    ) -> Self:
        """Logs to ``stream`` (stdout); spans per the ``OTEL_*`` variables (``TracingConfigError``
        when they name an exporter or protocol that does not exist), plus ``processor`` (tests)."""
        return cls(
            logger=make_logger(cls.SERVICE, stream, level=level),
            metrics=cls.new_metrics(),
            tracer_provider=make_tracer_provider(
                cls.SERVICE, processor=processor, record_unexported=cls.RECORD_UNEXPORTED
            ),
        )

    def shutdown(self) -> None:
        """Flush and stop span export (blocking: call it off the event loop)."""
        self.tracer_provider.shutdown()
