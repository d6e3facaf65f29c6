"""``PodTurns``: binds of one pod take turns on this replica.

kube-scheduler may bind a pod again while its first bind still runs (it retries after its
``httpTimeout``; kube-schedulers running without leader election each bind every pod). Each bind
records the GPUs it writes in the model before its Binding is sent, so two at once would each
replace the other's count, and for that time the GPUs the pod really gets count as free. Taking
turns per pod UID, a second bind starts only once the first has ended and the model holds its
outcome. Nothing is kept for a pod once no bind of it runs or waits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from hamipy.protocol.identifiers import PodUid

__all__ = ["PodTurns"]


class PodTurns:
    """One lock per pod UID with binds holding or waiting for it (FIFO, as ``asyncio.Lock``)."""

    def __init__(self) -> None:
        self._locks: dict[PodUid, asyncio.Lock] = {}
        self._users: collections.Counter[PodUid] = collections.Counter()

    def __len__(self) -> int:
        """Pods with a bind running or waiting."""
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def turn(self, uid: PodUid, timeout_s: float) -> AsyncIterator[bool]:
        """Wait up to ``timeout_s`` for the pod's turn: yields True holding it, False when the
        binds before this one still run after that time (it holds nothing then)."""
        lock = self._locks.setdefault(uid, asyncio.Lock())
        self._users[uid] += 1
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await lock.acquire()
            except TimeoutError:
                yield False
                return
            try:
                yield True
            finally:
                lock.release()
        finally:
            self._users[uid] -= 1
            if not self._users[uid]:
                del self._users[uid], self._locks[uid]
