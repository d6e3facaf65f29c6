"""The pod cache over the shared informer: the newest version of each pod whoever delivered it, and
our own writes kept across a list answered before they landed."""

from __future__ import annotations

import io
from typing import Any

import builders
from plugin_fakes import NODE, FakeKube

from hamipy.device_plugin.kube import node_pods_informer
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.kube.informer import InformerSettings
from hamipy.telemetry import make_logger


def pod(uid: str, version: int, phase: str = "allocating") -> dict[str, Any]:
    """Version ``version`` of pod ``uid``, told apart from its other versions by its bind ``phase``."""
    return builders.pod(
        uid,
        builders.container(),
        namespace="ns",
        uid=uid,
        resource_version=str(version),
        annotations=builders.allocation(phase=phase),
    )


def cache(api: FakeKube | None = None) -> PodCache:
    informer = node_pods_informer(
        api or FakeKube(), NODE, logger=make_logger("test", io.StringIO()), settings=InformerSettings()
    )
    return PodCache(informer)


def versions(c: PodCache) -> dict[str, str]:
    """uid -> the resourceVersion the cache holds."""
    return {p["metadata"]["uid"]: p["metadata"]["resourceVersion"] for p in c.pods()}


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


async def test_the_watch_adds_updates_and_deletes_pods() -> None:
    api = FakeKube([pod("listed", 1)])
    c = cache(api)
    await c.informer.list_once()
    await watch(
        c,
        api,
        ("ADDED", pod("watched", 5)),
        ("MODIFIED", pod("watched", 9, "success")),
        ("MODIFIED", pod("watched", 7, "failed")),  # older than what the cache holds
    )
    assert versions(c) == {"listed": "1", "watched": "9"}
    await watch(c, api, ("DELETED", pod("listed", 10)))
    assert c.pods() == [pod("watched", 9, "success")]


def test_a_fresh_read_adds_pods_new_to_us_and_keeps_newer_versions() -> None:
    c = cache()
    c.remember(pod("known", 4, "success"))
    c.merge([pod("b", 3), pod("a", 3), pod("known", 2)])
    assert versions(c) == {"known": "4", "b": "3", "a": "3"}
