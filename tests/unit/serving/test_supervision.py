"""A supervised task that dies is named in the log, fails readiness and ends the service."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from hamipy.serving.supervision import Supervisor
from hamipy.telemetry import make_logger


async def test_a_task_that_raises_is_logged_by_name_and_fails_the_service() -> None:
    log = io.StringIO()
    supervisor = Supervisor(make_logger("test", log))

    async def watch() -> None:
        raise TypeError("the stream sent a list")

    supervisor.start("pods-watch", watch())
    await asyncio.wait_for(supervisor.failed.wait(), timeout=5)
    assert supervisor.failure == "task pods-watch died: TypeError: the stream sent a list"
    [line] = [json.loads(x) for x in log.getvalue().splitlines()]
    assert (line["level"], line["task"]) == ("error", "pods-watch")
    assert line["exception"][0]["exc_type"] == "TypeError"
    await supervisor.stop()


async def test_a_forever_task_that_returns_is_a_failure_too() -> None:
    supervisor = Supervisor(make_logger("test", io.StringIO()))

    async def heartbeat() -> None:
        return None

    supervisor.start("heartbeat", heartbeat())
    await asyncio.wait_for(supervisor.failed.wait(), timeout=5)
    assert supervisor.failure == "task heartbeat died: returned"


async def test_stopping_cancels_without_failing() -> None:
    supervisor = Supervisor(make_logger("test", io.StringIO()))
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    supervisor.start("forever", forever())
    await started.wait()
    await supervisor.stop()
    assert not supervisor.failed.is_set()
    assert supervisor.failure is None


async def test_one_name_one_task() -> None:
    supervisor = Supervisor(make_logger("test", io.StringIO()))
    supervisor.start("x", asyncio.Event().wait())
    with pytest.raises(ValueError, match="already running"):
        supervisor.start("x", asyncio.Event().wait())
    await supervisor.stop()
