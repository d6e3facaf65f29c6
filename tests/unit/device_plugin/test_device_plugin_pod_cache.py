"""The pod cache over the shared informer: the newest version of each pod whoever delivered it, our
own writes kept across a list answered before they landed, and the order pods were bound."""

from __future__ import annotations

import io
from typing import Any

import builders
from plugin_fakes import NODE, FakeKube

from hamipy.device_plugin.kube import node_pods_informer
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.kube.informer import InformerSettings
from hamipy.telemetry import make_logger


def pod(uid: str, version: int, phase: str = "allocating", *, bind_time: int | None = None) -> dict[str, Any]:
    """Version ``version`` of pod ``uid``, told apart from its other versions by its bind ``phase``."""
    return builders.pod(
        uid,
        builders.container(),
        namespace="ns",
        uid=uid,
        resource_version=str(version),
        annotations=builders.allocation(phase=phase, bind_time=bind_time),
    )


def cache(api: FakeKube | None = None) -> PodCache:
    informer = node_pods_informer(
        api or FakeKube(), NODE, logger=make_logger("test", io.StringIO()), settings=InformerSettings()
    )
    return PodCache(informer)


def uids(c: PodCache) -> list[str]:
    return [p["metadata"]["uid"] for p in sorted(c.pods(), key=c.bind_order)]


async def watch(c: PodCache, api: FakeKube, *events: tuple[str, dict[str, Any]]) -> None:
    """Deliver ``events`` through one watch that the server then ends."""
    for kind, obj in events:
        api.events.put_nowait({"type": kind, "object": obj})
    api.events.put_nowait(None)
    await c.informer.watch_once()


def test_an_older_version_never_replaces_a_newer_one() -> None:
    c = cache()
    c.remember(pod("a", 7, "success"))
    c.remember(pod("a", 5, "allocating"))
    assert c.pods() == [pod("a", 7, "success")]
    c.remember(pod("a", 8, "failed"))
    assert c.pods() == [pod("a", 8, "failed")]


async def test_a_list_drops_pods_gone_and_keeps_our_newer_writes() -> None:
    api = FakeKube([pod("a", 6), pod("b", 6)])
    c = cache(api)
    c.remember(pod("a", 9, "success"))  # our write landed after the list below was answered
    c.remember(pod("gone", 3))
    await c.informer.list_once()
    assert sorted(c.pods(), key=lambda p: p["metadata"]["uid"]) == [pod("a", 9, "success"), pod("b", 6)]
    assert c.synced.is_set()


async def test_once_the_watch_confirms_a_write_the_next_list_is_the_truth() -> None:
    api = FakeKube([pod("a", 6)])
    c = cache(api)
    await c.informer.list_once()
    c.remember(pod("a", 9, "success"))
    await watch(c, api, ("MODIFIED", pod("a", 9, "success")))
    api.pods["a"] = pod("a", 12, "failed")  # someone else wrote since
    await c.informer.list_once()
    assert c.pods() == [pod("a", 12, "failed")]


async def test_bind_order_is_the_order_the_watch_saw_pods() -> None:
    api = FakeKube([pod("listed-late", 1, bind_time=20), pod("listed-early", 1, bind_time=10)])
    c = cache(api)
    await c.informer.list_once()
    await watch(
        c,
        api,
        ("ADDED", pod("watched-2", 5, bind_time=30)),
        ("ADDED", pod("watched-1", 6, bind_time=30)),  # same second, seen later
        ("MODIFIED", pod("watched-2", 9, bind_time=30)),  # an update keeps its place
    )
    assert uids(c) == ["listed-early", "listed-late", "watched-2", "watched-1"]
    await watch(c, api, ("DELETED", pod("listed-early", 10)))
    assert uids(c) == ["listed-late", "watched-2", "watched-1"]


def test_a_fresh_read_adds_pods_new_to_us_in_bind_time_order() -> None:
    c = cache()
    c.remember(pod("known", 4, bind_time=50))
    c.merge([pod("b", 3, bind_time=20), pod("a", 3, bind_time=10), pod("known", 2, bind_time=50)])
    assert uids(c) == ["known", "a", "b"]
    assert [p["metadata"]["resourceVersion"] for p in c.pods() if p["metadata"]["uid"] == "known"] == ["4"]
