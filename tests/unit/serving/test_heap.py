"""Handing the C heap's free pages back: on this (glibc) system the trim really lowers RSS after a
fragmenting pattern of allocations, and the forever-task trims on its interval."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hamipy.serving.heap import heap_trimmer, trim_heap_forever


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_trim_gives_fragmented_free_pages_back() -> None:
    trim = heap_trimmer()
    assert trim is not None, "glibc has malloc_trim: the services' images and CI run on it"
    # Python hands objects over 512 bytes to malloc. Keep one block in ten: the nine freed between
    # them (9 KiB runs, whole pages) stay resident, as free() only trims the top of the heap.
    blocks = [bytes(1024) + bytes([i % 256]) for i in range(60_000)]
    kept = blocks[::10]
    del blocks
    before = rss_mib()
    assert trim() is True
    after = rss_mib()
    assert before - after > 10, f"RSS {before:.1f} -> {after:.1f} MiB"
    assert len(kept) == 6_000


async def test_trims_on_its_interval_until_cancelled() -> None:
    calls = asyncio.Queue[None]()
    loop = asyncio.get_running_loop()

    def trim() -> bool:  # runs in a worker thread: counted on the loop's
        loop.call_soon_threadsafe(calls.put_nowait, None)
        return True

    task = asyncio.create_task(trim_heap_forever(trim, 0.01))
    for _ in range(3):
        await asyncio.wait_for(calls.get(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
