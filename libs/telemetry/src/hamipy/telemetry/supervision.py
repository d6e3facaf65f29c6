"""Background tasks that fail loudly: every service runs its long-lived tasks (watches, event
writers, heartbeats, servers' helpers) under one ``Supervisor``.

A task that ends for any reason but cancellation (an exception, or returning, which a forever-task
never should) is logged with its name and the error, marks the service not ready (``failure``: the
``/readyz`` answer), and sets ``failed``, on which the service's main loop ends the process with a
non-zero status: a service never keeps answering from state whose feed has died.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, Protocol

__all__ = ["Supervisor"]


class _Logger(Protocol):
    def error(self, event: str, **fields: Any) -> Any: ...


class Supervisor:
    """Starts named tasks and watches them."""

    def __init__(self, logger: _Logger) -> None:
        self.logger = logger
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.failed = asyncio.Event()
        self.failure: str | None = None
        """Why the service is no longer ready: ``"<task>: <error>"`` of the first task that died."""

    def start(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as the task ``name``; its death is reported (``failure``, ``failed``)."""
        if name in self.tasks and not self.tasks[name].done():
            coro.close()
            raise ValueError(f"a task named {name!r} is already running")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks[name] = task
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        reason = f"{type(error).__name__}: {error}" if error is not None else "returned"
        self.logger.error(
            "background task died; the service stops", task=task.get_name(), error=reason, exc_info=error
        )
        if self.failure is None:
            self.failure = f"task {task.get_name()} died: {reason}"
        self.failed.set()

    async def stop(self) -> None:
        """Cancel every task and wait for them to end."""
        running = [task for task in self.tasks.values() if not task.done()]
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()
