"""The Grafana dashboards import as they are, and every metric they query is declared by one of our
services (the monitor's collector, the extender's and the device plugin's registries; the
integration test checks the same against the live services)."""

from __future__ import annotations

import asyncio
import io
import re
from pathlib import Path
from typing import Any

import pytest
from dashboard_queries import dashboard_metrics, dashboards, exported_names, metric_names
from monitor_fakes import FakeHostGpus, telemetry
from prometheus_client import generate_latest

from hamipy.monitor.collector import ScrapeData, UsageCollector
from hamipy.monitor.usage import UsageReport

EXPECTED = {"hamipy-cluster.json", "hamipy-node.json", "hamipy-workload.json"}


def declared_names() -> set[str]:
    """What our services' registries expose with no GPU, pod or request seen yet."""
    from hamipy.device_plugin.telemetry import Telemetry as PluginTelemetry
    from hamipy.extender.model import ClusterModel
    from hamipy.extender.telemetry import Telemetry as ExtenderTelemetry

    t, _ = telemetry()
    empty = ScrapeData(usage=UsageReport((), (), 0), readings=(), host=FakeHostGpus([]).sample())
    t.metrics.registry.register(UsageCollector(lambda: empty, node="n", legacy=True))
    extender = ExtenderTelemetry.create(stream=io.StringIO())
    extender.metrics.attach(ClusterModel())
    plugin = PluginTelemetry.create(stream=io.StringIO())
    names: set[str] = set()
    for registry in (t.metrics.registry, plugin.metrics.registry):
        names |= exported_names(generate_latest(registry).decode())
    return names | exported_names(asyncio.run(extender.metrics.render()).decode())


def test_the_three_dashboards_are_there() -> None:
    assert set(dashboards()) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_dashboard_imports_as_is(name: str) -> None:
    board: dict[str, Any] = dashboards()[name]
    assert board["id"] is None, "an id would clash with an existing dashboard on import"
    assert board["uid"] == Path(name).stem
    assert board["title"].startswith("hami-py / ")
    assert isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in board["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["datasource"] == panel["datasource"]
    assert "${DS_" not in str(board), "no __inputs placeholders: the data source is a variable"


def test_every_metric_a_dashboard_queries_is_declared_by_our_services() -> None:
    declared = declared_names()
    missing = {name: sorted(dashboard_metrics(b) - declared) for name, b in dashboards().items()}
    assert missing == {name: [] for name in EXPECTED}


def test_the_dashboards_cover_the_three_views() -> None:
    boards = dashboards()
    assert {"hami_gpu_memory_allocated_bytes", "hami_gpu_memory_limit_bytes"} <= dashboard_metrics(
        boards["hamipy-cluster.json"]
    )
    assert {"hami_host_gpu_memory_used_bytes", "hami_host_gpu_utilization_ratio"} <= dashboard_metrics(
        boards["hamipy-node.json"]
    )
    assert {
        "hami_vgpu_memory_limit_bytes",
        "hami_vgpu_memory_used_bytes",
        "hamipy_monitor_container_region_state",
    } <= dashboard_metrics(boards["hamipy-workload.json"])


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (node) (hami_gpu_memory_limit_bytes{node=~"$node"})', {"hami_gpu_memory_limit_bytes"}),
        (
            "histogram_quantile(0.99, sum by (le) (rate(filter_seconds_bucket[5m])))",
            {"filter_seconds_bucket"},
        ),
        (
            'a * on (device_uuid) group_left (node) group by (device_uuid, node) (b{x="y"})',
            {"a", "b"},
        ),
        ('count(m{state="missing"} == 1) or vector(0)', {"m"}),
        ("x - on(ns) y offset 5m", {"x", "y"}),
    ],
    ids=["by-and-matcher", "histogram", "join", "or-vector", "offset"],
)
def test_metric_names_are_read_from_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_a_misspelt_metric_would_be_caught() -> None:
    declared = declared_names()
    assert "hami_vgpu_memory_used_bytes" in declared
    assert "hami_vgpu_memory_usedbytes" not in declared
    assert metric_names("sum(hami_vgpu_memory_usedbytes)") - declared == {"hami_vgpu_memory_usedbytes"}


# Every extender replica exports the whole cluster's allocation: summed as they come, two replicas
# would show twice the GPUs and twice the memory allocated.
EXTENDER_SERIES = (
    "hami_gpu_memory_limit_bytes",
    "hami_gpu_memory_allocated_bytes",
    "hami_gpu_core_limit_ratio",
    "hami_gpu_core_allocated_ratio",
    "hami_gpu_shared_count",
    "hami_node_gpu_overview",
    "hami_node_gpu_memory_allocated_ratio",
    "hami_vgpu_memory_allocated_bytes",
    "hami_vgpu_core_allocated_ratio",
)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_extenders_series_are_reduced_over_its_replicas_first(name: str) -> None:
    from dashboard_queries import queries

    unreduced = [
        expr
        for expr in queries(dashboards()[name])
        for metric in EXTENDER_SERIES
        for found in re.finditer(rf"\b{metric}\b", expr)
        if not re.search(r"max by \([\w, ]+\) \($", expr[: found.start()])
    ]
    assert unreduced == []


def test_series_the_alerts_and_latency_panels_read_exist_before_any_event() -> None:
    """A labelled series born at its first event hides that event from rate() and increase(): the
    latency panels showed NaN and a healthy node's region errors showed no data. Known label
    values start at zero."""
    from hamipy.device_plugin.telemetry import Telemetry as PluginTelemetry
    from hamipy.extender.telemetry import Telemetry as ExtenderTelemetry
    from hamipy.webhook.telemetry import Telemetry as WebhookTelemetry

    monitor, _ = telemetry()
    registries = {
        "extender": ExtenderTelemetry.create(stream=io.StringIO()).metrics.registry,
        "plugin": PluginTelemetry.create(stream=io.StringIO()).metrics.registry,
        "monitor": monitor.metrics.registry,
        "webhook": WebhookTelemetry.create(stream=io.StringIO()).metrics.registry,
    }
    expected = {
        "extender": [
            ("hamipy_extender_filter_duration_seconds_count", {"result": "fit"}),
            ("hamipy_extender_bind_duration_seconds_count", {"result": "bound"}),
            ("hamipy_extender_decisions_total", {"verb": "bind", "result": "refused", "reason": "refused"}),
        ],
        "plugin": [
            ("hamipy_device_plugin_allocate_duration_seconds_count", {"result": "success"}),
            ("hamipy_device_plugin_allocations_total", {"result": "failed", "reason": "NoPendingPod"}),
            ("hamipy_device_plugin_devices", {"health": "Unhealthy"}),
        ],
        "monitor": [("hamipy_monitor_region_errors_total", {"reason": "truncated"})],
        "webhook": [
            ("hamipy_webhook_admission_duration_seconds_count", {"outcome": "mutated"}),
            ("hamipy_webhook_bad_requests_total", {"reason": "not_json"}),
        ],
    }
    values = {
        (service, name): registries[service].get_sample_value(name, labels)
        for service, samples in expected.items()
        for name, labels in samples
    }
    assert values == dict.fromkeys(values, 0.0)
