"""A pending pod's retries add no filter spans while its decision stays the same, and its Event is
one series whose count rises."""

from __future__ import annotations

import io
from typing import Any

import pytest
from builders import gpu, gpu_node, gpu_pod
from extender_fakes import filter_args
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hamipy.extender.model import ClusterModel
from hamipy.extender.scheduler import Scheduler
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import NullKube
from hamipy.kube.events import EventRecorder
from hamipy.protocol.config import Config


@pytest.fixture
def scheduler() -> tuple[Scheduler, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create(stream=io.StringIO(), processor=SimpleSpanProcessor(exporter))
    model = ClusterModel(count_resource="nvidia.com/gpu")
    model.replace_nodes([gpu_node("a", [gpu("A", 0, mem=100)])])
    model.replace_pods([])
    sched = Scheduler(
        model=model,
        config=Config(),
        settings=ExtenderSettings(),
        telemetry=telemetry,
        events=EventRecorder(NullKube(), component="hamipy-extender", logger=telemetry.logger),
        binder=None,
    )
    return sched, exporter


def filter_spans(exporter: InMemorySpanExporter) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == "extender.filter"]


def test_a_pending_pods_identical_retries_add_no_spans(
    scheduler: tuple[Scheduler, InMemorySpanExporter],
) -> None:
    sched, exporter = scheduler
    pending = gpu_pod("p")  # asks more memory than node a's GPU has
    for _ in range(30):
        answer = sched.filter(filter_args(pending, ["a"]))
        assert answer["NodeNames"] == []
    [span] = filter_spans(exporter)
    assert span.attributes is not None
    assert span.attributes["hamipy.outcome"] == "failed"
    assert span.attributes["hamipy.filter.repeats"] == 0
    assert (
        sched.events.series_count(
            {"kind": "Pod", "name": "p", "namespace": "ns", "uid": "uid-ns-p"}, "FilteringFailed"
        )
        == 30
    )

    # The decision changes (another node appears and fits): a new span, saying how many it followed.
    sched.model.replace_nodes([gpu_node("a", [gpu("A", 0, mem=100)]), gpu_node("b")])
    answer = sched.filter(filter_args(pending, ["a", "b"]))
    assert answer["NodeNames"] == ["b"]
    _, second = filter_spans(exporter)
    assert second.attributes is not None
    assert (second.attributes["hamipy.outcome"], second.attributes["hamipy.filter.repeats"]) == ("fit", 29)


def test_a_changed_failure_is_a_new_span(scheduler: tuple[Scheduler, InMemorySpanExporter]) -> None:
    sched, exporter = scheduler
    pending = gpu_pod("p")
    sched.filter(filter_args(pending, ["a"]))
    sched.filter(filter_args(pending, ["a"]))
    sched.model.replace_nodes([gpu_node("a", [gpu("A", 0, mem=100)]), gpu_node("c", [gpu("C", 0, mem=200)])])
    sched.filter(filter_args(pending, ["a", "c"]))
    assert [s.attributes["hamipy.filter.repeats"] for s in filter_spans(exporter)] == [0, 1]
