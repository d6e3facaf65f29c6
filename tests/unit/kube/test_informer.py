"""The informer: list (paged), watch from the list's version with bookmarks, 410 and errors re-list
with jittered backoff, the cache by UID, ``listed`` readiness, and bugs that are not swallowed."""

from __future__ import annotations

import asyncio
import contextlib
import io
from typing import Any

import pytest
from builders import gpu_pod
from fake_kube import FakeKube, bookmark, gone, watch_event
from kube_support import running_task

from hamipy.devcluster import wait_for
from hamipy.kube.errors import KubeError
from hamipy.kube.informer import ChangeKind, Informer, InformerSettings
from hamipy.kube.resources import pod_path
from hamipy.telemetry import make_logger

FAST = InformerSettings(first_backoff_s=0.01, max_backoff_s=0.04, page_size=2)
PODS = pod_path()


def on_n1(name: str, version: int = 1) -> dict[str, Any]:
    return gpu_pod(name, node_name="n1", resource_version=str(version))


def version_of(api: FakeKube, name: str) -> str:
    """The resourceVersion of the pod ``name`` as stored: the server's latest write, when it was."""
    version: str = api.pod("ns", name)["metadata"]["resourceVersion"]
    return version


class Recorder:
    """The names each list and change told."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.changes: list[tuple[ChangeKind, str]] = []

    def listed(self, objects: list[dict[str, Any]]) -> None:
        self.lists.append([o["metadata"]["name"] for o in objects])

    def changed(self, kind: ChangeKind, item: dict[str, Any]) -> None:
        self.changes.append((kind, item["metadata"]["name"]))


def informer(api: FakeKube, **kwargs: Any) -> tuple[Informer, Recorder, list[str]]:
    restarts: list[str] = []
    inf = Informer(
        api,
        PODS,
        logger=make_logger("test", io.StringIO()),
        query=[("fieldSelector", "spec.nodeName=n1")],
        settings=FAST,
        on_restart=restarts.append,
        random_fraction=lambda: 0.0,
        **kwargs,
    )
    recorder = Recorder()
    inf.subscribe(recorder)
    return inf, recorder, restarts


def running(inf: Informer) -> contextlib.AbstractAsyncContextManager[asyncio.Task[None]]:
    return running_task(inf.run(), "informer")


async def until(condition: Any, what: str) -> None:
    await wait_for(lambda: True if condition() else None, timeout=5, interval=0.005, what=what)


async def test_lists_page_by_page_then_watches_from_the_lists_version() -> None:
    api = FakeKube(on_n1("a"), on_n1("b"), on_n1("c"), gpu_pod("elsewhere", node_name="n2"))
    listed_at = version_of(api, "elsewhere")
    api.send(
        PODS,
        watch_event("ADDED", on_n1("d", 911)),
        watch_event("MODIFIED", on_n1("a", 912)),
        watch_event("DELETED", on_n1("b", 913)),
    )
    inf, seen, _ = informer(api)
    async with running(inf):
        await until(lambda: len(seen.changes) == 3, "the watch's three events")
    assert seen.lists == [["a", "b", "c"]]
    assert seen.changes == [("ADDED", "d"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert sorted(inf.cache) == ["uid-ns-a", "uid-ns-c", "uid-ns-d"]
    assert inf.cache["uid-ns-a"]["metadata"]["resourceVersion"] == "912"
    assert inf.listed.is_set()
    assert inf.fresh
    # Pages asked with limit/continue and the selector (two of two); the watch from the list's version.
    first, second = api.requests
    assert "continue" not in first.query
    assert second.query["continue"]
    assert all(
        r.query["limit"] == "2" and r.query["fieldSelector"] == "spec.nodeName=n1" for r in api.requests
    )
    first_watch = api.watches[0].query
    assert (first_watch["resourceVersion"], first_watch["allowWatchBookmarks"]) == (listed_at, "true")
    assert first_watch["fieldSelector"] == "spec.nodeName=n1"


async def test_410_mid_watch_lists_again_and_drops_what_was_deleted_meanwhile() -> None:
    api = FakeKube(on_n1("a"), on_n1("b"))
    resumed = asyncio.Event()
    api.send(PODS, watch_event("MODIFIED", on_n1("a", 911)), resumed, gone())
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: seen.changes == [("MODIFIED", "a")], "the watch's event")
        api.remove(pod_path("ns", "b"))  # deleted while nobody watches (after the 410)
        api.write(pod_path("ns", "a"), {"metadata": {"labels": {"x": "y"}}})
        resumed.set()
        await until(lambda: len(seen.lists) == 2, "the re-list after 410")
    assert restarts == ["gone"]
    assert seen.lists == [["a", "b"], ["a"]]
    assert list(inf.cache) == ["uid-ns-a"]
    assert api.watches[-1].query["resourceVersion"] == version_of(api, "a")


async def test_bookmarks_advance_the_version_without_changes() -> None:
    api = FakeKube(on_n1("a"))
    api.send(PODS, bookmark(915), bookmark(917), None)  # then the server ends the watch
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(api.watches) == 2, "the watch re-opened")
    assert seen.changes == []
    assert restarts == ["closed"]
    assert api.watches[1].query["resourceVersion"] == "917"
    assert len(seen.lists) == 1, "a closed watch is re-opened, not re-listed"


async def test_a_dropped_connection_relists_after_a_backoff() -> None:
    api = FakeKube(on_n1("a"))
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(seen.lists) == 1, "listed")
        api.add(on_n1("b"))
        api.fail(KubeError("GET /api/v1/pods: HTTP 503", status=503), "GET", PODS, times=1)  # still down
        api.send(PODS, watch_event("ADDED", api.pod("ns", "b")), KubeError("WATCH: ServerDisconnectedError"))
        await until(lambda: len(seen.lists) == 2, "the re-list once the API is back")
    assert restarts == ["error", "error"]
    assert seen.lists[1] == ["a", "b"]
    assert inf.fresh
    assert api.watches[-1].query["resourceVersion"] == version_of(api, "b")


async def test_not_fresh_while_failing() -> None:
    api = FakeKube(on_n1("a"))
    inf, _, restarts = informer(api)
    async with running(inf):
        await until(inf.listed.is_set, "listed")
        api.fail(KubeError("GET /api/v1/pods: HTTP 503", status=503), "GET", PODS)  # every later list
        api.send(PODS, KubeError("broken"))
        await until(lambda: len(restarts) >= 2, "two failures")
        assert not inf.fresh
        assert inf.listed.is_set(), "listed once: readiness stays"


async def test_a_bug_in_a_handler_or_the_stream_is_not_swallowed() -> None:
    api = FakeKube(on_n1("a"))
    api.send(PODS, watch_event("ADDED", on_n1("b", 911)), TypeError("unexpected"))
    inf, _, _ = informer(api)
    with pytest.raises(TypeError, match="unexpected"):
        await asyncio.wait_for(inf.run(), timeout=5)


async def test_an_error_status_in_the_stream_is_a_kube_error() -> None:
    api = FakeKube()
    api.send(PODS, {"type": "ERROR", "object": {"code": 500, "message": "etcd"}})
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(seen.lists) == 2, "listed again")
    assert restarts == ["error"]


def test_own_writes_are_remembered_and_never_replaced_by_an_older_event() -> None:
    inf, seen, _ = informer(FakeKube())
    inf.remember(on_n1("a", 20))
    inf._apply("MODIFIED", on_n1("a", 15))  # the watch delivers an older version late
    assert inf.cache["uid-ns-a"]["metadata"]["resourceVersion"] == "20"
    assert seen.changes == [("MODIFIED", "a")]
    inf._apply("MODIFIED", on_n1("a", 21))
    assert inf.cache["uid-ns-a"]["metadata"]["resourceVersion"] == "21"


def test_without_a_cache_every_change_still_reaches_the_handlers() -> None:
    inf, seen, _ = informer(FakeKube(), keep=False)
    inf._apply("ADDED", on_n1("a", 2))
    inf._apply("MODIFIED", on_n1("a", 1))
    assert inf.cache == {}
    assert seen.changes == [("ADDED", "a"), ("MODIFIED", "a")]


async def test_a_list_answered_before_our_own_write_does_not_undo_it() -> None:
    api = FakeKube(on_n1("a"))
    inf, _, _ = informer(api)
    await inf.list_once()
    inf.remember(on_n1("a", 930))
    # Written before our write (v930) landed, and so listed: a, older, and b.
    api.write(pod_path("ns", "a"), {"metadata": {"labels": {"x": "y"}}})
    api.add(on_n1("b"))
    async with running(inf):
        await until(lambda: inf.lists >= 2, "the re-list")
    assert inf.cache["uid-ns-a"]["metadata"]["resourceVersion"] == "930"
    assert sorted(inf.cache) == ["uid-ns-a", "uid-ns-b"]


async def test_a_watch_line_that_is_not_an_event_is_an_api_error() -> None:
    api = FakeKube(on_n1("a"))
    api.send(PODS, [])  # type: ignore[arg-type]
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(seen.lists) == 2, "listed again after the bad line")
    assert restarts == ["error"]
