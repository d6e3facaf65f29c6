"""This node's pods, kept current by the shared informer, for Allocate to read without an API call.

An Allocate that had to list the node's pods would pay for decoding every pod on the node each time,
within Allocate's 50 ms target (``tests/bench/bench_allocate.py`` runs 100 pods a node). The pods
come from a ``hamipy.kube.informer.Informer`` of ``spec.nodeName=<node>`` (paged list, watch with
bookmarks, re-list on 410 Gone, jittered backoff on API errors); its cache is the plugin's view. The
plugin's own writes are applied at once from the API's answer (``remember``), so the next Allocate
sees them before the watch delivers them, and a list that was answered before such a write landed
does not take it back (the watch then brings the same version). A pod the cache does not know yet
makes the caller read the node's pods afresh (``merge``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from hamipy.kube.informer import Informer

__all__ = ["PodCache"]


class PodCache:
    """``pods()``: this node's pods as last seen; ``run()`` keeps them current."""

    def __init__(self, informer: Informer) -> None:
        self.informer = informer

    @property
    def synced(self) -> asyncio.Event:
        """Set after the first complete list."""
        return self.informer.listed

    async def run(self) -> None:
        """The informer's list+watch, forever (``KubeError`` retried; anything else raised)."""
        await self.informer.run()

    def pods(self) -> list[dict[str, Any]]:
        return list(self.informer.cache.values())

    def remember(self, pod: dict[str, Any]) -> None:
        """A pod as the API returned it to our own write (an older version never replaces a newer,
        and a list answered before the write landed does not take it back: the informer's rules)."""
        self.informer.remember(pod)

    def merge(self, pods: list[dict[str, Any]]) -> None:
        """A fresh read of the node's pods (Allocate's fallback): each newer one into the cache."""
        for pod in pods:
            self.informer.remember(pod)
