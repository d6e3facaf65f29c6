"""Releasing HAMi's node lock: only the releasing pod's, only by a version-guarded write."""

from __future__ import annotations

import builders
import pytest
from fake_kube import FakeKube

from hamipy.kube.node_lock import release_node_lock
from hamipy.kube.resources import node_path
from hamipy.protocol import keys

LOCK = "2025-06-18T09:06:27Z,ml,train-0"


def locked(lock: str | None) -> FakeKube:
    """An API server holding node ``n1`` with ``lock`` (None: no lock)."""
    return FakeKube(builders.node("n1", annotations={keys.NODE_LOCK: lock} if lock else {}))


def patches(api: FakeKube) -> int:
    return api.calls.count(("PATCH", node_path("n1")))


async def test_the_owner_releases_its_lock() -> None:
    api = locked(LOCK)
    assert await release_node_lock(api, "n1", namespace="ml", name="train-0") == "released"
    assert keys.NODE_LOCK not in api.node("n1")["metadata"]["annotations"]


@pytest.mark.parametrize(
    "lock", [None, "2025-06-18T09:06:27Z,ml,other", "garbage"], ids=["none", "other-pod", "malformed"]
)
async def test_another_pods_or_no_lock_is_left_alone(lock: str | None) -> None:
    api = locked(lock)
    assert await release_node_lock(api, "n1", namespace="ml", name="train-0") == "not-ours"
    assert patches(api) == 0


async def test_lost_races_are_retried_then_given_up() -> None:
    api = locked(LOCK)
    api.race(node_path("n1"), times=2)
    assert await release_node_lock(api, "n1", namespace="ml", name="train-0") == "released"
    assert keys.NODE_LOCK not in api.node("n1")["metadata"]["annotations"]
    api = locked(LOCK)
    api.race(node_path("n1"), times=10)
    assert await release_node_lock(api, "n1", namespace="ml", name="train-0", attempts=3) == "contended"
    assert patches(api) == 3
    assert api.node("n1")["metadata"]["annotations"][keys.NODE_LOCK] == LOCK
