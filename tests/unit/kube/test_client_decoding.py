"""``RawKube`` decodes what the API server sends (msgspec): answers whole, watch events line by line
however the chunks split them, and anything that is not JSON, or nests past the parser's depth, as a
``KubeError`` naming the call (never an exception that would end an informer as a bug)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from hamipy.kube.client import RawKube
from hamipy.kube.errors import KubeError

EVENT_A = b'{"type":"ADDED","object":{"metadata":{"name":"a"}}}'
EVENT_B = b'{"type":"MODIFIED","object":{"metadata":{"name":"b","labels":{"x":"\\u00e9"}}}}'
DEEP = b"[" * 5000 + b"]" * 5000


def _app(watch_chunks: list[bytes], answer: bytes) -> web.Application:
    async def watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for chunk in watch_chunks:
            await response.write(chunk)
            await asyncio.sleep(0)  # a chunk of its own on the wire, as the API server flushes them
        await response.write_eof()
        return response

    async def get(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_get("/watch", watch)
    app.router.add_get("/get", get)
    return app


@contextlib.asynccontextmanager
async def _kube(watch_chunks: list[bytes], answer: bytes = b"{}") -> AsyncIterator[RawKube]:
    runner = web.AppRunner(_app(watch_chunks, answer), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    client = ApiClient(Configuration(host=f"http://127.0.0.1:{runner.addresses[0][1]}"))
    try:
        yield RawKube(client)
    finally:
        await client.close()
        await runner.cleanup()


async def _events(kube: RawKube) -> list[dict[str, object]]:
    return [event async for event in kube.stream("/watch", query=(), inactivity_s=5)]


async def test_watch_events_are_whole_however_the_chunks_split_them() -> None:
    chunks = [EVENT_A[:10], EVENT_A[10:] + b"\n" + EVENT_B[:5], EVENT_B[5:] + b"\n\n"]
    async with _kube(chunks) as kube:
        events = await _events(kube)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED"]
    assert events[1]["object"] == {"metadata": {"name": "b", "labels": {"x": "\u00e9"}}}


@pytest.mark.parametrize("line", [b"not json", DEEP, b'{"a": NaN}'], ids=["garbage", "too-deep", "nan"])
async def test_a_watch_line_that_cannot_be_read_is_a_kube_error(line: bytes) -> None:
    async with _kube([EVENT_A + b"\n" + line + b"\n"]) as kube:
        with pytest.raises(KubeError, match="WATCH /watch"):
            await _events(kube)


async def test_answers_are_decoded_and_garbage_is_a_kube_error() -> None:
    async with _kube([], answer=b'{"kind": "Pod", "n": 12345678901234567890}') as kube:
        assert await kube.request("GET", "/get") == {"kind": "Pod", "n": 12345678901234567890}
    async with _kube([], answer=DEEP) as kube:
        with pytest.raises(KubeError, match="GET /get: the answer is not JSON"):
            await kube.request("GET", "/get")


async def test_a_chunk_of_many_events_lets_other_work_in_between_them() -> None:
    # The API server flushes a burst of events as one chunk; a filter that arrives meanwhile must
    # not wait for the whole burst to be applied.
    burst = b"".join(EVENT_A + b"\n" for _ in range(6))
    async with _kube([burst]) as kube:
        order: list[str] = []
        async for _ in kube.stream("/watch", query=(), inactivity_s=5):
            order.append("event")
            if len(order) == 1:
                asyncio.get_running_loop().call_soon(order.append, "other")
    assert order.count("event") == 6
    assert order.index("other") <= 2
