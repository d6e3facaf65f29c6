"""Releasing HAMi's node lock: only the releasing pod's, only by a version-guarded write."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from hamipy.kube.errors import Conflict
from hamipy.kube.node_lock import release_node_lock
from hamipy.protocol import keys

LOCK = "2025-06-18T09:06:27Z,ml,train-0"


class OneNode:
    """A node whose writes are resourceVersion-guarded; ``races`` makes the next writes lose."""

    def __init__(self, lock: str | None) -> None:
        annotations = {keys.NODE_LOCK: lock} if lock else {}
        self.node: dict[str, Any] = {
            "metadata": {"name": "n1", "resourceVersion": "1", "annotations": annotations}
        }
        self.races = 0
        self.patches = 0

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str = "",
        timeout_s: float = 1.0,
    ) -> Any:
        if method == "GET":
            return copy.deepcopy(self.node)
        self.patches += 1
        meta = self.node["metadata"]
        if self.races:
            self.races -= 1
            meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        if body["metadata"]["resourceVersion"] != meta["resourceVersion"]:
            raise Conflict("resourceVersion", status=409)
        for key, value in body["metadata"]["annotations"].items():
            if value is None:
                meta["annotations"].pop(key, None)
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return copy.deepcopy(self.node)

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]], inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError


async def test_the_owner_releases_its_lock() -> None:
    node = OneNode(LOCK)
    assert await release_node_lock(node, "n1", namespace="ml", name="train-0") == "released"
    assert keys.NODE_LOCK not in node.node["metadata"]["annotations"]


@pytest.mark.parametrize(
    "lock", [None, "2025-06-18T09:06:27Z,ml,other", "garbage"], ids=["none", "other-pod", "malformed"]
)
async def test_another_pods_or_no_lock_is_left_alone(lock: str | None) -> None:
    node = OneNode(lock)
    assert await release_node_lock(node, "n1", namespace="ml", name="train-0") == "not-ours"
    assert node.patches == 0


async def test_lost_races_are_retried_then_given_up() -> None:
    node = OneNode(LOCK)
    node.races = 2
    assert await release_node_lock(node, "n1", namespace="ml", name="train-0") == "released"
    node = OneNode(LOCK)
    node.races = 10
    assert await release_node_lock(node, "n1", namespace="ml", name="train-0", attempts=3) == "contended"
    assert node.patches == 3
