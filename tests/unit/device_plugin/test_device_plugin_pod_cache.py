"""The pod cache over the shared informer: the newest version of each pod whoever delivered it, and
our own writes kept across a list answered before they landed."""

from __future__ import annotations

import copy
import io
from typing import Any

import builders
from fake_kube import FakeKube, watch_event
from plugin_fakes import NODE, PODS, node_kube

from hamipy.device_plugin.kube import node_pods_informer
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.kube.informer import InformerSettings
from hamipy.kube.resources import pod_path
from hamipy.protocol import keys
from hamipy.telemetry import make_logger


def pod(name: str, version: int, phase: str = "allocating") -> dict[str, Any]:
    """Version ``version`` of pod ``name`` on NODE, told apart from its others by its bind ``phase``."""
    return builders.gpu_pod(
        name,
        builders.container(),
        node_name=NODE,
        annotations=builders.allocation(phase=phase),
        resource_version=str(version),
    )


def cache(api: FakeKube | None = None) -> PodCache:
    informer = node_pods_informer(
        api or node_kube(), NODE, logger=make_logger("test", io.StringIO()), settings=InformerSettings()
    )
    return PodCache(informer)


def versions(c: PodCache) -> dict[str, str]:
    """name -> the resourceVersion the cache holds."""
    return {p["metadata"]["name"]: p["metadata"]["resourceVersion"] for p in c.pods()}


async def watch(c: PodCache, api: FakeKube, *events: tuple[str, dict[str, Any]]) -> None:
    """Deliver ``events`` through one watch that the server then ends."""
    api.send(PODS, *(watch_event(kind, obj) for kind, obj in events), None)
    await c.informer.watch_once()


def phase_written(api: FakeKube, name: str, phase: str) -> dict[str, Any]:
    """Pod ``name``'s bind phase written through the API server: the pod as it answers."""
    api.write(pod_path("ns", name), {"metadata": {"annotations": {keys.BIND_PHASE: phase}}})
    return copy.deepcopy(api.pod("ns", name))


def test_an_older_version_never_replaces_a_newer_one() -> None:
    c = cache()
    c.remember(pod("a", 7, "success"))
    c.remember(pod("a", 5, "allocating"))
    assert c.pods() == [pod("a", 7, "success")]
    c.remember(pod("a", 8, "failed"))
    assert c.pods() == [pod("a", 8, "failed")]


async def test_a_list_drops_pods_gone_and_keeps_our_newer_writes() -> None:
    api = node_kube(pod("a", 6), pod("b", 6))
    c = cache(api)
    c.remember(pod("a", 909, "success"))  # our write landed after the list below was answered
    c.remember(pod("gone", 3))
    await c.informer.list_once()
    assert sorted(c.pods(), key=lambda p: p["metadata"]["name"]) == [
        pod("a", 909, "success"),
        api.pod("ns", "b"),
    ]
    assert c.synced.is_set()


async def test_once_the_watch_confirms_a_write_the_next_list_is_the_truth() -> None:
    api = node_kube(pod("a", 6))
    c = cache(api)
    await c.informer.list_once()
    ours = phase_written(api, "a", "success")
    c.remember(ours)
    await watch(c, api, ("MODIFIED", ours))
    phase_written(api, "a", "failed")  # someone else wrote since
    await c.informer.list_once()
    assert c.pods() == [api.pod("ns", "a")]
    assert api.pod("ns", "a")["metadata"]["annotations"][keys.BIND_PHASE] == "failed"


async def test_the_watch_adds_updates_and_deletes_pods() -> None:
    api = node_kube(pod("listed", 1))
    c = cache(api)
    await c.informer.list_once()
    await watch(
        c,
        api,
        ("ADDED", pod("watched", 905)),
        ("MODIFIED", pod("watched", 909, "success")),
        ("MODIFIED", pod("watched", 907, "failed")),  # older than what the cache holds
    )
    assert versions(c) == {"listed": api.pod("ns", "listed")["metadata"]["resourceVersion"], "watched": "909"}
    await watch(c, api, ("DELETED", pod("listed", 910)))
    assert c.pods() == [pod("watched", 909, "success")]


def test_a_fresh_read_adds_pods_new_to_us_and_keeps_newer_versions() -> None:
    c = cache()
    c.remember(pod("known", 4, "success"))
    c.merge([pod("b", 3), pod("a", 3), pod("known", 2)])
    assert versions(c) == {"known": "4", "b": "3", "a": "3"}
