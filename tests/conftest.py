"""Suite-wide test hygiene: an async test that leaves asyncio tasks running fails, a unit test that
hangs fails after 30 s, and the developer's own ``OTEL_*`` settings do not reach the services under
test."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest


@pytest.fixture
async def _no_leaked_tasks() -> AsyncIterator[None]:
    before = asyncio.all_tasks()
    yield
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    if leaked:
        # The coroutine's name too: an unnamed task (a library's) says nothing by its name alone.
        coro = "__qualname__"
        names = ", ".join(sorted(f"{t.get_name()} ({getattr(t.get_coro(), coro, '?')})" for t in leaked))
        for task in leaked:
            task.cancel()
        pytest.fail(f"test left asyncio tasks running: {names}")


UNIT_TIMEOUT_S = 30
"""A unit test runs in milliseconds; one that hangs should fail in seconds, not after the suite's
300 s (kept for the integration tests, which start processes)."""
UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # Only coroutine tests get the check: sync (and hypothesis) tests have no loop to leak into.
        func = getattr(item, "function", None)
        if func is not None and inspect.iscoroutinefunction(func):
            item.fixturenames.insert(0, "_no_leaked_tasks")  # type: ignore[attr-defined]
        if item.path.is_relative_to(UNIT) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))


def pytest_configure(config: pytest.Config) -> None:
    # The services read OTEL_* from the process environment, as the OpenTelemetry SDK does: a shell's
    # exporter settings must not send the suite's spans anywhere, nor turn off the spans tests check.
    # Tests that need a variable set it themselves (monkeypatch, or a service process's env).
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        del os.environ[name]
