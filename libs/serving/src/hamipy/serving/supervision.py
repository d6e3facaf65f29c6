"""Background tasks that fail loudly: every service runs its long-lived tasks (watches, event
writers, heartbeats, servers' helpers) under one ``Supervisor``.

A task that ends for any reason but cancellation (an exception, or returning, which a forever-task
never should) is logged with its name and the error, marks the service not ready (``failure``: the
``/readyz`` answer), and sets ``failed``, on which the service's main loop ends the process with a
non-zero status: a service never keeps answering from state whose feed has died.

``serve_until_signal`` is that main loop, the same in every service: run until SIGTERM or SIGINT
(exit status 0) or until a supervised task dies (1), saying which in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, Protocol

__all__ = ["STOP_SIGNALS", "Supervisor", "serve_until_signal", "stop_on_signals"]

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


class _Logger(Protocol):
    def error(self, event: str, **fields: Any) -> Any: ...

    def info(self, event: str, **fields: Any) -> Any: ...


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

    async def wait(self, stop: asyncio.Event) -> str | None:
        """Return once ``stop`` is set (None: a clean stop) or a task has died (its ``failure``): a
        service's main loop, which then ends the process with status 0 or 1."""
        waiters = [
            asyncio.get_running_loop().create_task(event.wait(), name=f"supervisor-wait-{name}")
            for name, event in (("stop", stop), ("failed", self.failed))
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.wait(waiters)
        return self.failure

    async def run(self, running: AbstractAsyncContextManager[Any], stop: asyncio.Event) -> str | None:
        """Enter ``running`` (the service: its servers and supervised tasks), wait until ``stop`` is
        set or a task dies, leave it; the failure, or None for a clean stop."""
        async with running:
            await self.wait(stop)
        return self.failure

    async def stop(self) -> None:
        """Cancel every task and wait for them to end."""
        running = [task for task in self.tasks.values() if not task.done()]
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event that SIGTERM and SIGINT set (the kubelet's stop, Ctrl-C); the handlers are removed
    on exit."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def serve_until_signal(
    running: AbstractAsyncContextManager[Any], supervisor: Supervisor, logger: _Logger
) -> int:
    """A service's main loop: ``running`` until SIGTERM/SIGINT (0) or until a task of
    ``supervisor`` dies (1: the supervisor has logged which and why); either way ``running``'s exit
    fails readiness first and drains what is in flight."""
    with stop_on_signals() as stop:
        async with running:
            failure = await supervisor.wait(stop)
            # Said before the drain, so the log reads in the order things happen.
            if failure is not None:
                logger.error("stopping: a background task died", reason=failure)
            else:
                logger.info("stopping on signal")
    return 0 if failure is None else 1
