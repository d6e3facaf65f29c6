"""What a service's HTTP limits did, as its tests read it back from the service's own Prometheus
registry (the ``<prefix>_http_connections*`` metrics of ``hamipy.serving.http_metrics``).

Any test imports it as ``connection_metrics``: ``tests/`` is on ``sys.path`` (see ``builders``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

__all__ = ["closed"]


def closed(registry: CollectorRegistry, prefix: str, server: str) -> dict[str, float]:
    """``<prefix>_http_connections_closed_total`` of one server (``api``, ``probes``), by reason."""
    return {
        sample.labels["reason"]: sample.value
        for metric in registry.collect()
        if metric.name == f"{prefix}_http_connections_closed"
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["server"] == server
    }
