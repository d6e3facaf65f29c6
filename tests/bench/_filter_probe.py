"""The filter probe of ``bench_e2e.py --filter-probe``, in a process of its own (as kube-scheduler
is): the bench process's own loop, busy creating pods and reading their watch, would otherwise add
its lag to every sample.

``python _filter_probe.py URL INTERVAL_S``; reads one line from stdin, the ``/filter`` body, then
POSTs it every ``INTERVAL_S`` until stdin closes, and prints the latencies (seconds) as a JSON list.

The extender closes an idle kept-alive connection when kube-scheduler's binds fill its connection
cap (``hamipy.telemetry.http_limits``); a probe that meets its connection closed asks again on a new
one, as Go's client does, and that sample includes the new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time

import aiohttp


async def probe(url: str, interval_s: float) -> list[float]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    payload = (await reader.readline()).strip()
    closed = asyncio.ensure_future(reader.read())  # the bench closes stdin to stop us
    samples: list[float] = []
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while not closed.done():
            started = time.perf_counter()
            for attempt in (1, 2):
                try:
                    async with session.post(f"{url}/filter", data=payload, headers=headers) as resp:
                        await resp.read()
                        resp.raise_for_status()
                    break
                except aiohttp.ClientConnectionError:  # closed under us: once more, on a new connection
                    if attempt == 2:
                        raise
            samples.append(time.perf_counter() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(closed), interval_s)
    return samples


if __name__ == "__main__":
    print(json.dumps(asyncio.run(probe(sys.argv[1], float(sys.argv[2])))))
