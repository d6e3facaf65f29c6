"""``RawKube.request`` on the wire: what the API server receives (method, path, query, the client's
token and default headers, the content type, the body as JSON) and how its answer comes back."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from hamipy.kube.client import MERGE_PATCH, RawKube, api_client
from hamipy.kube.errors import Conflict

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{server}"}}}}]
users: [{{name: u, user: {{token: abc}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
"""


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append(
            {
                "method": request.method,
                "path": request.path,
                "query": list(request.query.items()),
                "headers": dict(request.headers),
                "body": json.loads(body) if body else None,
            }
        )
        if request.path.endswith("/conflict"):
            return web.json_response({"kind": "Status", "reason": "Conflict", "code": 409}, status=409)
        return web.json_response({"kind": "Pod", "metadata": {"name": "p"}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_a_call_reaches_the_server_as_the_client_is_configured(
    server: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url, seen = server
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG.format(server=url))
    client = await api_client(str(config))
    try:
        kube = RawKube(client)
        body = {"metadata": {"annotations": {"hami.io/vgpu-node": "n1", "note": "gpü"}}}
        answer = await kube.request(
            "PATCH",
            "/api/v1/namespaces/ns/pods/p",
            query=[("fieldManager", "hamipy"), ("dryRun", "All")],
            body=body,
            content_type=MERGE_PATCH,
        )
        assert answer == {"kind": "Pod", "metadata": {"name": "p"}}
        assert await kube.request("GET", "/api/v1/nodes/n1") == answer
        with pytest.raises(Conflict):
            await kube.request("POST", "/api/v1/conflict", body={})
    finally:
        await client.close()
    patch, get, conflict = seen
    assert (patch["method"], patch["path"]) == ("PATCH", "/api/v1/namespaces/ns/pods/p")
    assert patch["query"] == [("fieldManager", "hamipy"), ("dryRun", "All")]
    assert patch["body"] == body
    assert patch["headers"]["Content-Type"] == MERGE_PATCH
    assert patch["headers"]["Accept"] == "application/json"
    assert patch["headers"]["Authorization"] == "Bearer abc"
    assert patch["headers"]["User-Agent"] == client.default_headers["User-Agent"]
    assert (get["method"], get["query"], get["body"]) == ("GET", [], None)
    assert get["headers"]["Authorization"] == "Bearer abc"
    assert conflict["body"] == {}  # an empty object is still sent, as JSON
