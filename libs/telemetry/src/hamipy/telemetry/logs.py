"""structlog JSON lines for every service: the service name, the current trace and span ids, and
exceptions rendered without the frames' local variables (they hold request bodies and tokens)."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog
from opentelemetry import trace
from structlog.tracebacks import ExceptionDictTransformer

__all__ = ["add_trace_ids", "make_logger"]


def add_trace_ids(
    logger: object, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: ``trace_id``/``span_id`` (W3C hex) of the span current where the line
    is logged, so that a log line can be found from its trace and back. Nothing when there is none
    (tracing off, or outside a request)."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", format(context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(context.span_id, "016x"))
    return event_dict


# Frames and exception text, never the frames' locals (structlog shows them by default).
_render_exception = structlog.processors.ExceptionRenderer(
    ExceptionDictTransformer(show_locals=False, use_rich=False)
)


def make_logger(
    service: str, stream: TextIO | None = None, *, level: int = logging.INFO
) -> structlog.typing.FilteringBoundLogger:
    """A JSON-lines logger writing to ``stream`` (stdout by default), carrying ``service``."""
    logger: structlog.typing.FilteringBoundLogger = structlog.wrap_logger(
        structlog.WriteLogger(stream if stream is not None else sys.stdout),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            add_trace_ids,
            _render_exception,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=True,
    )
    return logger.bind(service=service)
