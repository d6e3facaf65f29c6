"""One task a loop turn: work that arrives in bursts waits its turn behind the requests that arrive
meanwhile, instead of running ahead of them.

The apiserver answers Bindings in bursts (etcd commits them in batches), and asyncio runs every
callback made ready in one turn of the loop before it polls its sockets again: ten binds finishing
at once would run back to back, and a ``/filter`` that arrived meanwhile be read only after all of
them (docs/extender.md#what-a-filter-waits-behind). ``OnePerTurn.turn()`` lets the tasks waiting
on it go on one per turn of the loop, and each turn begins with a poll, so a filter that arrives
during a burst is read and answered after at most about one waiting task.
"""

from __future__ import annotations

import asyncio
import collections

__all__ = ["OnePerTurn"]


class OnePerTurn:
    """Lets the tasks awaiting ``turn()`` go on one per turn of the running loop, first come first
    served. A task cancelled while it waits gives up its place."""

    def __init__(self) -> None:
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._releasing = False

    def __len__(self) -> int:
        """Tasks waiting now (not those cancelled while they waited)."""
        return sum(1 for waiter in self._waiting if not waiter.done())

    async def turn(self) -> None:
        """Return on a later turn of the loop, after every task that waited here before."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiting.append(waiter)
        if not self._releasing:
            self._releasing = True
            loop.call_soon(self._release, loop)
        await waiter

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        # A callback scheduled from a callback runs on the next turn, after the loop has polled.
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # cancelled meanwhile: the next one goes instead
                waiter.set_result(None)
                break
        if self._waiting:
            loop.call_soon(self._release, loop)
        else:
            self._releasing = False
