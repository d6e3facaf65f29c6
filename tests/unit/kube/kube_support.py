"""``running_task``: a background coroutine for the length of a block."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def running_task(coro: Coroutine[Any, Any, None], name: str) -> AsyncIterator[asyncio.Task[None]]:
    """``coro`` as a task while the block runs; cancelled and awaited after it."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
