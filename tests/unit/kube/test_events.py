"""Events aggregate as client-go's recorder does: one object per pod and reason whose count and last
time rise, written at most once per interval, under a name that replicas and restarts share."""

from __future__ import annotations

import contextlib
import io
from collections.abc import AsyncIterator, Callable
from typing import Any

from fake_kube import FakeKube, path_of
from kube_support import running_task

from hamipy.devcluster import wait_for
from hamipy.kube.client import NullKube
from hamipy.kube.errors import KubeError
from hamipy.kube.events import DropReason, EventRecorder
from hamipy.telemetry import make_logger

POD = {"kind": "Pod", "name": "train", "namespace": "ml", "uid": "uid-1"}
EVENTS = "/api/v1/events"


@contextlib.asynccontextmanager
async def running(sink: EventRecorder) -> AsyncIterator[EventRecorder]:
    async with running_task(sink.run(), "events"):
        yield sink


def make_sink(api: FakeKube | NullKube, *, interval: float = 0.2, **kwargs: Any) -> EventRecorder:
    return EventRecorder(
        api,
        component="hamipy-test",
        logger=make_logger("test", io.StringIO()),
        on_drop=DROPPED.append,
        update_interval_s=interval,
        **kwargs,
    )


DROPPED: list[DropReason] = []


def events_of(api: FakeKube, reason: str, uid: str = "uid-1") -> list[dict[str, Any]]:
    """The Events of ``reason`` about the pod ``uid``."""
    return [e for e in api.items(EVENTS) if e["reason"] == reason and e["involvedObject"]["uid"] == uid]


async def until(condition: Callable[[], bool], what: str) -> None:
    await wait_for(lambda: True if condition() else None, timeout=10, interval=0.01, what=what)


async def test_repeats_raise_one_events_count_instead_of_new_objects() -> None:
    api = FakeKube()
    async with running(make_sink(api)) as sink:
        sink.emit(POD, "FilteringFailed", "no node fits: 3 nodes CardInsufficientMemory", warning=True)
        await until(lambda: len(api.items(EVENTS)) == 1, "the first occurrence written at once")
        for _ in range(29):
            sink.emit(POD, "FilteringFailed", "no node fits: 3 nodes CardInsufficientMemory", warning=True)
        await until(lambda: api.items(EVENTS)[0]["count"] == 30, "the count of 30 written back")
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
        await until(lambda: len(api.items(EVENTS)) == 3, "three series")
        sink.emit(POD, "FilteringFailed", "second", warning=True)
        await until(lambda: events_of(api, "FilteringFailed")[0]["count"] == 2, "the repeat written")
    assert [e["message"] for e in events_of(api, "FilteringFailed")] == ["second"]
    assert [e["message"] for e in events_of(api, "FilteringFailed", "uid-2")] == ["x"]


async def test_a_second_writer_of_the_same_series_adds_to_its_count() -> None:
    """Another replica (or this extender before a restart) made the Event: the create is refused,
    the existing count is read and ours is added to it."""
    api = FakeKube()
    async with running(make_sink(api)) as first:
        first.emit(POD, "FilteringFailed", "m", warning=True)
        first.emit(POD, "FilteringFailed", "m", warning=True)
        await until(
            lambda: bool(api.items(EVENTS)) and api.items(EVENTS)[0]["count"] == 2, "the first writer's count"
        )
    async with running(make_sink(api)) as second:
        second.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: api.items(EVENTS)[0]["count"] == 3, "the second writer's occurrence added")
    assert len(api.items(EVENTS)) == 1


async def test_an_expired_event_is_made_again() -> None:
    api = FakeKube()
    async with running(make_sink(api, interval=0.05)) as sink:
        sink.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: len(api.items(EVENTS)) == 1, "created")
        for event in api.items(EVENTS):  # the API server's event TTL (1 h) passed
            api.remove(path_of(event))
        sink.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: len(api.items(EVENTS)) == 1, "created again")
    assert api.items(EVENTS)[0]["count"] == 2


async def test_api_errors_are_counted_and_the_sink_keeps_going() -> None:
    api = FakeKube()
    api.fail(KubeError("down", status=503), "POST", "/api/v1/namespaces/ml/events")
    sink = make_sink(api, interval=0.05)
    DROPPED.clear()
    async with running(sink):
        sink.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: DROPPED == ["api-error"], "the failed write reported")
        api.heal()
        sink.emit(POD, "FilteringFailed", "m", warning=True)
        await until(lambda: len(api.items(EVENTS)) == 1, "written once the API is back")
    assert api.items(EVENTS)[0]["count"] == 2


def test_series_are_bounded_least_recent_first() -> None:
    sink = make_sink(NullKube(), cache_size=2)
    for i in range(3):
        sink.emit({**POD, "uid": f"u{i}"}, "FilteringFailed", "m")
    assert [sink.series_count({**POD, "uid": f"u{i}"}, "FilteringFailed") for i in range(3)] == [0, 1, 1]


def test_a_full_write_queue_drops_and_counts() -> None:
    sink = make_sink(NullKube(), size=1)
    DROPPED.clear()
    sink.emit({**POD, "uid": "a"}, "FilteringFailed", "m")
    sink.emit({**POD, "uid": "b"}, "FilteringFailed", "m")
    assert DROPPED == ["queue-full"]
