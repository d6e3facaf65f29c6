"""Suite-wide test hygiene: an async test that leaves asyncio tasks running fails."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import pytest


@pytest.fixture
async def _no_leaked_tasks() -> AsyncIterator[None]:
    before = asyncio.all_tasks()
    yield
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    if leaked:
        names = ", ".join(sorted(t.get_name() for t in leaked))
        for task in leaked:
            task.cancel()
        pytest.fail(f"test left asyncio tasks running: {names}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Only coroutine tests get the check: sync (and hypothesis) tests have no loop to leak into.
    for item in items:
        func = getattr(item, "function", None)
        if func is not None and inspect.iscoroutinefunction(func):
            item.fixturenames.insert(0, "_no_leaked_tasks")  # type: ignore[attr-defined]
