"""The pod cache keeps the newest version of each pod, whoever delivered it."""

from __future__ import annotations

import io
from typing import Any, cast

from hamipy.device_plugin.kube import NodeApi
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.telemetry import Telemetry


def pod(uid: str, version: int, phase: str = "allocating") -> dict[str, Any]:
    return {"metadata": {"uid": uid, "resourceVersion": str(version), "annotations": {"phase": phase}}}


def cache() -> PodCache:
    return PodCache(cast(NodeApi, object()), Telemetry(log_stream=io.StringIO()))


def test_an_older_version_never_replaces_a_newer_one() -> None:
    c = cache()
    c.remember(pod("a", 7, "success"))
    c.remember(pod("a", 5, "allocating"))
    assert c.pods() == [pod("a", 7, "success")]
    c.remember(pod("a", 8, "failed"))
    assert c.pods() == [pod("a", 8, "failed")]


def test_a_list_drops_pods_gone_and_keeps_newer_writes() -> None:
    c = cache()
    c.remember(pod("a", 9, "success"))  # our own write, newer than the list below
    c.remember(pod("gone", 3))
    c.replace([pod("a", 6), pod("b", 6)])
    assert sorted(c.pods(), key=lambda p: p["metadata"]["uid"]) == [pod("a", 9, "success"), pod("b", 6)]


def stamped(uid: str, version: int, bind_time: int) -> dict[str, Any]:
    p = pod(uid, version)
    p["metadata"]["annotations"]["hami.io/bind-time"] = str(bind_time)
    return p


def test_bind_order_is_the_order_the_watch_saw_pods() -> None:
    c = cache()
    c.replace([stamped("listed-late", 1, 20), stamped("listed-early", 1, 10)])
    c.remember(stamped("watched-2", 5, 30))
    c.remember(stamped("watched-1", 6, 30))  # same second, seen later
    c.remember(stamped("watched-2", 9, 30))  # an update keeps its place
    ordered = sorted(c.pods(), key=c.bind_order)
    assert [p["metadata"]["uid"] for p in ordered] == [
        "listed-early",
        "listed-late",
        "watched-2",
        "watched-1",
    ]
