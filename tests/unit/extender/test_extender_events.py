"""Events aggregate as client-go's recorder does: one object per pod and reason whose count and last
time rise, written at most once per interval; and a pending pod's retries add no filter spans while
its decision stays the same."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from extender_fakes import FakeKube, gpu, node, pod
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hamipy.devcluster import wait_for
from hamipy.extender.errors import KubeError
from hamipy.extender.events import EventSink
from hamipy.extender.model import ClusterModel
from hamipy.extender.scheduler import Scheduler
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.protocol.config import Config

POD = {"kind": "Pod", "name": "train", "namespace": "ml", "uid": "uid-1"}


@contextlib.asynccontextmanager
async def running(sink: EventSink) -> AsyncIterator[EventSink]:
    task = asyncio.create_task(sink.run(), name="events")
    try:
        yield sink
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def make_sink(api: FakeKube | None, *, interval: float = 0.2, **kwargs: Any) -> EventSink:
    return EventSink(api, Telemetry.create(stream=io.StringIO()), update_interval_s=interval, **kwargs)


def events_of(api: FakeKube, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.events if e["reason"] == reason]


async def until(condition: Callable[[], bool], what: str) -> None:
    await wait_for(lambda: True if condition() else None, timeout=10, interval=0.01, what=what)


async def test_repeats_raise_one_events_count_instead_of_new_objects() -> None:
    api = FakeKube()
    async with running(make_sink(api)) as sink:
        sink.emit(POD, "FilteringFailed", "no node fits: 3 nodes CardInsufficientMemory", warning=True)
        await until(lambda: len(api.events) == 1, "the first occurrence written at once")
        for _ in range(29):
            sink.emit(POD, "FilteringFailed", "no node fits: 3 nodes CardInsufficientMemory", warning=True)
        await until(lambda: api.events[0]["count"] == 30, "the count of 30 written back")
    [event] = events_of(api, "FilteringFailed")
    assert event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == "uid-1"
    assert event["lastTimestamp"] >= event["firstTimestamp"]
    writes = [call for call in api.calls if "/events" in call[1]]
    assert len(writes) <= 3, f"30 occurrences written {len(writes)} times: {writes}"


async def test_another_reason_or_pod_is_another_event_and_the_latest_message_is_kept() -> None:
    api = FakeKube()
    async with running(make_sink(api, interval=0.05)) as sink:
        sink.emit(POD, "FilteringFailed", "first", warning=True)
        sink.emit(POD, "BindingFailed", "lock", warning=True)
        sink.emit({**POD, "name": "other", "uid": "uid-2"}, "FilteringFailed", "x", warning=True)
        await until(lambda: len(api.events) == 3, "three series")
        sink.emit(POD, "FilteringFailed", "second", warning=True)
        await until(lambda: events_of(api, "FilteringFailed")[0]["count"] == 2, "the repeat written")
    mine = [e for e in events_of(api, "FilteringFailed") if e["involvedObject"]["uid"] == "uid-1"]
    assert [e["message"] for e in mine] == ["second"]


async def test_a_second_writer_of_the_same_series_adds_to_its_count() -> None:
    """Another replica (or this extender before a restart) made the Event: the create is refused,
    the existing count is read and ours is added to it."""
    api = FakeKube()
    async with running(make_sink(api)) as first:
        first.emit(POD, "FilteringFailed", "m", warning=True)
        first.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: bool(api.events) and api.events[0]["count"] == 2, "the first writer's count")
    async with running(make_sink(api)) as second:
        second.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: api.events[0]["count"] == 3, "the second writer's occurrence added")
    assert len(api.events) == 1


async def test_an_expired_event_is_made_again() -> None:
    api = FakeKube()
    async with running(make_sink(api, interval=0.05)) as sink:
        sink.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: len(api.events) == 1, "created")
        api.events.clear()  # the API server's event TTL (1 h) passed
        sink.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: len(api.events) == 1, "created again")
    assert api.events[0]["count"] == 2


async def test_api_errors_are_counted_and_the_sink_keeps_going() -> None:
    api = FakeKube()
    api.fail[("POST", "/api/v1/namespaces/ml/events")] = KubeError("down", status=503)
    sink = make_sink(api, interval=0.05)
    async with running(sink):
        sink.emit(POD, "FilteringFailed", "m", warning=True)
        dropped = sink.telemetry.metrics.registry.get_sample_value
        await until(
            lambda: (dropped("hamipy_extender_events_dropped_total", {"reason": "api-error"}) or 0) == 1,
            "the failed write counted",
        )
        del api.fail[("POST", "/api/v1/namespaces/ml/events")]
        sink.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: len(api.events) == 1, "written once the API is back")
    assert api.events[0]["count"] == 2


def test_series_are_bounded_least_recent_first() -> None:
    sink = make_sink(None, cache_size=2)
    for i in range(3):
        sink.emit({**POD, "uid": f"u{i}"}, "FilteringFailed", "m")
    assert [sink.series_count({**POD, "uid": f"u{i}"}, "FilteringFailed") for i in range(3)] == [0, 1, 1]


def test_a_full_write_queue_drops_and_counts() -> None:
    sink = make_sink(None, size=1)
    sink.emit({**POD, "uid": "a"}, "FilteringFailed", "m")
    sink.emit({**POD, "uid": "b"}, "FilteringFailed", "m")
    value = sink.telemetry.metrics.registry.get_sample_value(
        "hamipy_extender_events_dropped_total", {"reason": "queue-full"}
    )
    assert value == 1


# -- a pending pod's spans ------------------------------------------------------------------------------


@pytest.fixture
def scheduler() -> tuple[Scheduler, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create(stream=io.StringIO(), processor=SimpleSpanProcessor(exporter))
    model = ClusterModel(count_resource="nvidia.com/gpu")
    model.replace_nodes([node("a", [gpu("A", 0, mem=100)])])
    model.replace_pods([])
    sched = Scheduler(
        model=model,
        config=Config(),
        settings=ExtenderSettings(),
        telemetry=telemetry,
        events=EventSink(None, telemetry),
        binder=None,
    )
    return sched, exporter


def filter_spans(exporter: InMemorySpanExporter) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == "extender.filter"]


def test_a_pending_pods_identical_retries_add_no_spans(
    scheduler: tuple[Scheduler, InMemorySpanExporter],
) -> None:
    sched, exporter = scheduler
    pending = pod("p")  # asks more memory than node a's GPU has
    for _ in range(30):
        answer = sched.filter({"Pod": pending, "NodeNames": ["a"]})
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
    sched.model.replace_nodes([node("a", [gpu("A", 0, mem=100)]), node("b")])
    answer = sched.filter({"Pod": pending, "NodeNames": ["a", "b"]})
    assert answer["NodeNames"] == ["b"]
    _, second = filter_spans(exporter)
    assert second.attributes is not None
    assert (second.attributes["hamipy.outcome"], second.attributes["hamipy.filter.repeats"]) == ("fit", 29)


def test_a_changed_failure_is_a_new_span(scheduler: tuple[Scheduler, InMemorySpanExporter]) -> None:
    sched, exporter = scheduler
    pending = pod("p")
    sched.filter({"Pod": pending, "NodeNames": ["a"]})
    sched.filter({"Pod": pending, "NodeNames": ["a"]})
    sched.model.replace_nodes([node("a", [gpu("A", 0, mem=100)]), node("c", [gpu("C", 0, mem=200)])])
    sched.filter({"Pod": pending, "NodeNames": ["a", "c"]})
    assert [s.attributes["hamipy.filter.repeats"] for s in filter_spans(exporter)] == [0, 1]
