"""What the HTTP limits did, as Prometheus metrics: a service registers one
``HttpConnectionsCollector`` and adds each ``BoundedServer`` it starts under a name (``api``,
``probes``), so an operator sees slow or flooding clients being cut (docs/security.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hamipy.serving.connection_cap import ConnectionStats
from hamipy.serving.http_limits import BoundedServer

__all__ = ["CLOSE_REASONS", "HttpConnectionsCollector"]

CLOSE_REASONS: tuple[tuple[str, str], ...] = (
    ("header_timeout", "header_timeouts"),
    ("body_timeout", "body_timeouts"),
    ("idle_timeout", "idle_timeouts"),
    ("evicted", "evicted"),
    ("refused", "refused"),
    ("queue_timeout", "queue_timeouts"),
    ("client_gone", "client_gone"),
)
"""The ``reason`` label and the ``ConnectionStats`` field it counts."""


class HttpConnectionsCollector(Collector):
    """``<prefix>_http_connections{server}`` (held now), ``<prefix>_http_connections_queued{server}``
    (waiting for a slot now), ``<prefix>_http_connections_accepted_total``,
    ``<prefix>_http_connections_http2_total`` (of those, the ones that chose HTTP/2),
    ``<prefix>_http_connections_waited_total`` (ever waited in the queue) and
    ``<prefix>_http_connections_closed_total{server,reason}`` (cut by a limit, or lost by the client
    mid-request), read from the servers' own counters at scrape time. Every reason is exported from
    the start, at 0."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._servers: dict[str, ConnectionStats] = {}

    def add(self, name: str, server: BoundedServer) -> None:
        self._servers[name] = server.stats

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            f"{self.prefix}_http_connections", "Connections held now, per server.", labels=["server"]
        )
        queued = GaugeMetricFamily(
            f"{self.prefix}_http_connections_queued",
            "Connections waiting for a slot now (every held one serving a request), per server.",
            labels=["server"],
        )
        accepted = CounterMetricFamily(
            f"{self.prefix}_http_connections_accepted",
            "Connections given a slot, at once or from the queue.",
            labels=["server"],
        )
        http2 = CounterMetricFamily(
            f"{self.prefix}_http_connections_http2",
            "Of the connections accepted, those that chose HTTP/2 in their TLS handshake.",
            labels=["server"],
        )
        queued_total = CounterMetricFamily(
            f"{self.prefix}_http_connections_waited",
            "Connections that waited in the queue for a slot.",
            labels=["server"],
        )
        closed = CounterMetricFamily(
            f"{self.prefix}_http_connections_closed",
            "Connections closed by a limit (a slow request head or body, an idle kept-alive "
            "connection, evicted or refused at the connection cap, or queued past the header timeout), "
            "or by the client before its request was answered.",
            labels=["server", "reason"],
        )
        for name, stats in sorted(self._servers.items()):
            held.add_metric([name], stats.held)
            queued.add_metric([name], stats.queued)
            accepted.add_metric([name], stats.accepted)
            http2.add_metric([name], stats.http2)
            queued_total.add_metric([name], stats.queued_total)
            for reason, field in CLOSE_REASONS:
                closed.add_metric([name, reason], getattr(stats, field))
        yield held
        yield queued
        yield accepted
        yield http2
        yield queued_total
        yield closed
