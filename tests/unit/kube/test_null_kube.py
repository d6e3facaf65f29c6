"""``NullKube``, the client of the no-API mode: writes go nowhere, reads find nothing, a watch
delivers nothing, and an Event recorder on it records without writing or counting a drop."""

from __future__ import annotations

import io
from typing import Any

import pytest
from kube_support import running_task

from hamipy.devcluster import wait_for
from hamipy.kube.client import KubeApi, NullKube
from hamipy.kube.errors import NotFound
from hamipy.kube.events import DropReason, EventRecorder
from hamipy.telemetry import make_logger

POD = {"kind": "Pod", "name": "train", "namespace": "ml", "uid": "uid-1"}


class SeenWrites(NullKube):
    """``NullKube`` that notes the calls it was handed (what the recorder tried to write)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        self.calls.append((method, path))
        return await super().request(method, path, **kwargs)


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
async def test_a_write_is_accepted_and_goes_nowhere(method: str) -> None:
    api: KubeApi = NullKube()
    assert await api.request(method, "/api/v1/namespaces/ml/events", body={"kind": "Event"}) == {}


async def test_a_read_finds_nothing_and_says_where() -> None:
    with pytest.raises(NotFound, match="/api/v1/nodes/a: no cluster") as found:
        await NullKube().request("GET", "/api/v1/nodes/a")
    assert found.value.status == 404


async def test_a_watch_ends_at_once_with_no_event() -> None:
    events = [e async for e in NullKube().stream("/api/v1/pods", query=(), inactivity_s=1.0)]
    assert events == []


async def test_events_are_recorded_not_written_and_no_drop_is_counted() -> None:
    api = SeenWrites()
    dropped: list[DropReason] = []
    log = io.StringIO()
    sink = EventRecorder(
        api, component="hamipy-test", logger=make_logger("test", log), on_drop=dropped.append
    )
    async with running_task(sink.run(), "events"):
        sink.emit(POD, "FilteringFailed", "no node fits", warning=True)
        await wait_for(lambda: api.calls or None, timeout=10, interval=0.01, what="the write handed over")
    assert api.calls == [("POST", "/api/v1/namespaces/ml/events")]
    assert [e.reason for e in sink.recorded] == ["FilteringFailed"]
    assert sink.series_count(POD, "FilteringFailed") == 1
    assert dropped == []
    assert "event not written" not in log.getvalue()
