"""Handing the C heap's free pages back to the kernel, so that a long-running service's RSS follows
what it holds.

glibc's ``free`` returns memory to the kernel only from the top of its heap. A service that keeps a
large model for days and, in between, allocates and frees request bodies, watch events and TLS
records (Python hands every object over 512 bytes to ``malloc``) leaves free chunks between live
ones. Under pod churn the extender's bytes in use stay flat while its heap, and RSS with it, rises
in small steps (``tests/bench/bench_churn.py``, docs/benchmarks.md#extender-memory-under-churn).
``malloc_trim(0)`` gives back every whole free page inside the heap (``madvise``), not only the top.

``trim_heap_forever`` calls it every ``interval_s`` from a worker thread: it takes the allocator's
locks, not the GIL, so the event loop runs on (a ``malloc`` on the loop waits for the trim).
``heap_trimmer`` is None where the C library has no ``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable

__all__ = ["heap_trimmer", "trim_heap_forever"]


@functools.cache
def heap_trimmer() -> Callable[[], bool] | None:
    """The C library's ``malloc_trim(0)`` (True when it gave memory back), or None without one."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: the C library's among them
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: bool(trim(0))


async def trim_heap_forever(trim: Callable[[], bool], interval_s: float) -> None:
    """``trim`` (``heap_trimmer()``) every ``interval_s``, until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trim)
