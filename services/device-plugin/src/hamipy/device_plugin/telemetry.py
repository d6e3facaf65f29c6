"""Logs, metrics and traces of the device plugin, with no module-level state
(docs/design.md#8-observable-by-default).

Metrics live on a per-instance ``CollectorRegistry``:

- ``hamipy_device_plugin_allocate_duration_seconds{result}``: one Allocate call, end to end.
- ``hamipy_device_plugin_allocations{result,reason}``: containers served or refused, by cause.
- ``hamipy_device_plugin_devices{health}``: fake devices advertised to the kubelet.
- ``hamipy_device_plugin_registrations{result}``: Register calls to the kubelet.
- ``hamipy_device_plugin_node_register_writes{result}``: writes of the register annotation.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hamipy.telemetry.service import ServiceTelemetry

__all__ = ["SERVICE_NAME", "Metrics", "Telemetry"]

SERVICE_NAME: Final = "hamipy-device-plugin"
# Allocate reads the node's pods and patches one: a few API round trips.
_ALLOCATE_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Metrics:
    """The plugin's Prometheus metrics on their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.allocate_seconds = Histogram(
            "hamipy_device_plugin_allocate_duration_seconds",
            "Duration of one Allocate call from the kubelet",
            ["result"],
            buckets=_ALLOCATE_BUCKETS,
            registry=self.registry,
        )
        self.allocations = Counter(
            "hamipy_device_plugin_allocations",
            "Containers served (result=success) or refused (result=failed) by Allocate, by reason",
            ["result", "reason"],
            registry=self.registry,
        )
        self.devices = Gauge(
            "hamipy_device_plugin_devices",
            "Fake devices advertised to the kubelet, by health",
            ["health"],
            registry=self.registry,
        )
        self.registrations = Counter(
            "hamipy_device_plugin_registrations",
            "Register calls to the kubelet",
            ["result"],
            registry=self.registry,
        )
        self.register_writes = Counter(
            "hamipy_device_plugin_node_register_writes",
            "Writes of the node's register annotation and handshake",
            ["result"],
            registry=self.registry,
        )
        # Known label values start at zero: a series that appears only at its first event hides
        # that event from rate() and increase() (dashboards show nothing, alerts see no increase).
        # Other refusal reasons are exception names, caught by the alerts' "unless offset" rule.
        for result in ("success", "failed"):
            self.allocate_seconds.labels(result=result)
            self.registrations.labels(result=result)
            self.register_writes.labels(result=result)
        self.allocations.labels(result="success", reason="Allocated")
        self.allocations.labels(result="failed", reason="NoPendingPod")
        for health in ("Healthy", "Unhealthy"):
            self.devices.labels(health=health)


class Telemetry(ServiceTelemetry[Metrics]):
    """Logger, metrics and tracer of one plugin instance."""

    SERVICE = SERVICE_NAME
    TRACER_NAME = "hamipy.device_plugin"

    @classmethod
    def new_metrics(cls) -> Metrics:
        return Metrics()
