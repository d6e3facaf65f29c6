"""The informer: list (paged), watch from the list's version with bookmarks, 410 and errors re-list
with jittered backoff, the cache by UID, ``listed`` readiness, and bugs that are not swallowed."""

from __future__ import annotations

import asyncio
import contextlib
import io
from typing import Any

import pytest
from kube_fakes import ScriptedKube, bookmark, event, gone, obj, running_task

from hamipy.devcluster import wait_for
from hamipy.kube.errors import KubeError
from hamipy.kube.informer import ChangeKind, Informer, InformerSettings
from hamipy.telemetry import make_logger

FAST = InformerSettings(first_backoff_s=0.01, max_backoff_s=0.04, page_size=2)


class Recorder:
    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.changes: list[tuple[ChangeKind, str]] = []

    def listed(self, objects: list[dict[str, Any]]) -> None:
        self.lists.append([o["metadata"]["uid"] for o in objects])

    def changed(self, kind: ChangeKind, item: dict[str, Any]) -> None:
        self.changes.append((kind, item["metadata"]["uid"]))


def informer(api: ScriptedKube, **kwargs: Any) -> tuple[Informer, Recorder, list[str]]:
    restarts: list[str] = []
    inf = Informer(
        api,
        "/api/v1/pods",
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
    api = ScriptedKube()
    api.lists.append([([obj("a", 1), obj("b", 2)], "next", ""), ([obj("c", 3)], "", "10")])
    api.streams.append(
        [event("ADDED", obj("d", 11)), event("MODIFIED", obj("a", 12)), event("DELETED", obj("b", 13))]
    )
    inf, seen, _ = informer(api)
    async with running(inf):
        await until(lambda: len(seen.changes) == 3, "the watch's three events")
    assert seen.lists == [["a", "b", "c"]]
    assert seen.changes == [("ADDED", "d"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert sorted(inf.cache) == ["a", "c", "d"]
    assert inf.cache["a"]["metadata"]["resourceVersion"] == "12"
    assert inf.listed.is_set()
    assert inf.fresh
    # Pages asked with limit/continue and the selector; the watch from the list's version.
    assert [c[2].get("continue") for c in api.calls] == [None, "next"]
    assert all(c[2]["limit"] == "2" and c[2]["fieldSelector"] == "spec.nodeName=n1" for c in api.calls)
    first_watch = api.watches[0]
    assert (first_watch["resourceVersion"], first_watch["allowWatchBookmarks"]) == ("10", "true")
    assert first_watch["fieldSelector"] == "spec.nodeName=n1"


async def test_410_mid_watch_lists_again_and_drops_what_was_deleted_meanwhile() -> None:
    api = ScriptedKube()
    api.lists.append([([obj("a", 1), obj("b", 2)], "", "10")])
    api.streams.append([event("MODIFIED", obj("a", 11)), gone()])
    api.lists.append([([obj("a", 20)], "", "20")])  # b was deleted while nobody watched
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(seen.lists) == 2, "the re-list after 410")
    assert restarts == ["gone"]
    assert seen.lists == [["a", "b"], ["a"]]
    assert list(inf.cache) == ["a"]
    assert api.watches[-1]["resourceVersion"] == "20"


async def test_bookmarks_advance_the_version_without_changes() -> None:
    api = ScriptedKube()
    api.lists.append([([obj("a", 1)], "", "10")])
    api.streams.append([bookmark(15), bookmark(17)])  # then the server ends the watch
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(api.watches) == 2, "the watch re-opened")
    assert seen.changes == []
    assert restarts == ["closed"]
    assert api.watches[1]["resourceVersion"] == "17"
    assert len(seen.lists) == 1, "a closed watch is re-opened, not re-listed"


async def test_a_dropped_connection_relists_after_a_backoff() -> None:
    api = ScriptedKube()
    api.lists.append([([obj("a", 1)], "", "10")])
    api.streams.append([event("ADDED", obj("b", 11)), KubeError("WATCH: ServerDisconnectedError")])
    api.lists.append(KubeError("GET /api/v1/pods: HTTP 503", status=503))  # still down
    api.lists.append([([obj("a", 1), obj("b", 11)], "", "30")])
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(seen.lists) == 2, "the re-list once the API is back")
    assert restarts == ["error", "error"]
    assert inf.fresh
    assert api.watches[-1]["resourceVersion"] == "30"


async def test_not_fresh_while_failing() -> None:
    api = ScriptedKube()
    api.lists.append([([obj("a", 1)], "", "10")])
    api.streams.append([KubeError("broken")])
    inf, _, restarts = informer(api)  # every later list fails: nothing scripted
    async with running(inf):
        await until(lambda: len(restarts) >= 2, "two failures")
        assert not inf.fresh
        assert inf.listed.is_set(), "listed once: readiness stays"


async def test_a_bug_in_a_handler_or_the_stream_is_not_swallowed() -> None:
    api = ScriptedKube()
    api.lists.append([([obj("a", 1)], "", "10")])
    api.streams.append([event("ADDED", obj("b", 11)), TypeError("unexpected")])
    inf, _, _ = informer(api)
    with pytest.raises(TypeError, match="unexpected"):
        await asyncio.wait_for(inf.run(), timeout=5)


async def test_an_error_status_in_the_stream_is_a_kube_error() -> None:
    api = ScriptedKube()
    api.lists.append([([], "", "10")])
    api.streams.append([{"type": "ERROR", "object": {"code": 500, "message": "etcd"}}])
    api.lists.append([([], "", "11")])
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(seen.lists) == 2, "listed again")
    assert restarts == ["error"]


def test_own_writes_are_remembered_and_never_replaced_by_an_older_event() -> None:
    inf, seen, _ = informer(ScriptedKube())
    inf.remember(obj("a", 20))
    inf._apply("MODIFIED", obj("a", 15))  # the watch delivers an older version late
    assert inf.cache["a"]["metadata"]["resourceVersion"] == "20"
    assert seen.changes == [("MODIFIED", "a")]
    inf._apply("MODIFIED", obj("a", 21))
    assert inf.cache["a"]["metadata"]["resourceVersion"] == "21"


def test_without_a_cache_every_change_still_reaches_the_handlers() -> None:
    inf, seen, _ = informer(ScriptedKube(), keep=False)
    inf._apply("ADDED", obj("a", 2))
    inf._apply("MODIFIED", obj("a", 1))
    assert inf.cache == {}
    assert seen.changes == [("ADDED", "a"), ("MODIFIED", "a")]


async def test_a_list_answered_before_our_own_write_does_not_undo_it() -> None:
    api = ScriptedKube()
    api.lists.append([([obj("a", 1)], "", "10")])
    api.lists.append([([obj("a", 5), obj("b", 6)], "", "20")])  # taken before our write (v30) landed
    inf, _, _ = informer(api)
    await inf.list_once()
    inf.remember(obj("a", 30))
    async with running(inf):
        await until(lambda: inf.lists >= 2, "the re-list")
    assert inf.cache["a"]["metadata"]["resourceVersion"] == "30"
    assert sorted(inf.cache) == ["a", "b"]


async def test_a_watch_line_that_is_not_an_event_is_an_api_error() -> None:
    api = ScriptedKube()
    api.lists.append([([obj("a", 1)], "", "10")])
    api.streams.append([[]])  # type: ignore[list-item]
    api.lists.append([([obj("a", 1)], "", "11")])
    inf, seen, restarts = informer(api)
    async with running(inf):
        await until(lambda: len(seen.lists) == 2, "listed again after the bad line")
    assert restarts == ["error"]
