"""A node agent (device plugin, monitor) run as its own process against a fake API server over
HTTP: how the process ends (SIGTERM, a background task that dies) without a control plane.
Shared by ``tests/unit/device_plugin`` and ``tests/unit/monitor``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from hamipy.devcluster import wait_for

DIED = "background task died; the service stops"

# Run the monitor's CLI with its pod cache's change handler broken: the first watch event raises
# TypeError in the informer's task, as a bug would. argv: module, then the CLI's arguments. (The
# device plugin's pod cache has no handler of its own: its test breaks the informer another way.)
INJECT_BUG = """
import importlib, sys
module = sys.argv[1]
pod_cache = importlib.import_module(module.rsplit(".", 1)[0] + ".pod_cache")
def changed(self, kind, obj):
    raise TypeError("injected")
pod_cache.PodCache.changed = changed
sys.exit(importlib.import_module(module).main(sys.argv[2:]))
"""


class FakeApiServer:
    """Lists ``pods`` of every node, answers a watch with the lines ``send`` queues (``watching``
    is set while one is open), and keeps one Node for GET and merge PATCH (``async with``)."""

    def __init__(self, node: str, pods: Sequence[dict[str, Any]] = ()) -> None:
        self.node: dict[str, Any] = {"metadata": {"name": node, "resourceVersion": "1", "annotations": {}}}
        self.pods = list(pods)
        self.watching = asyncio.Event()
        self._lines: asyncio.Queue[bytes] = asyncio.Queue()
        self._runner: web.AppRunner | None = None
        self._streams: set[asyncio.Task[Any]] = set()
        self.port = 0

    async def __aenter__(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch_node)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        # A watch's handler outlives its client (aiohttp does not cancel it): end them first.
        for task in self._streams:
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path

    def send(self, event: dict[str, Any]) -> None:
        self._lines.put_nowait(json.dumps(event).encode() + b"\n")

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "true":
            return web.json_response(
                {"kind": "PodList", "items": self.pods, "metadata": {"resourceVersion": "5"}}
            )
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        self.watching.set()
        try:
            while True:
                await resp.write(await self._lines.get())
        finally:
            self.watching.clear()
            self._streams.discard(task)

    async def _get_node(self, request: web.Request) -> web.Response:
        return web.json_response(self.node)

    async def _patch_node(self, request: web.Request) -> web.Response:
        patch = await request.json()
        annotations = self.node["metadata"]["annotations"]
        for key, value in (patch.get("metadata") or {}).get("annotations", {}).items():
            if value is None:
                annotations.pop(key, None)
            else:
                annotations[key] = value
        return web.json_response(self.node)


class AgentProcess:
    """One agent process (``python -c``/``-m`` ``argv``), its stdout and stderr in ``log``."""

    def __init__(self, argv: Sequence[str], *, log: Path, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.log = log
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> AgentProcess:
        with self.log.open("wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, *self.argv, stdout=out, stderr=asyncio.subprocess.STDOUT, env=self.env
            )
        return self

    async def wait_up(self, server: FakeApiServer, *, timeout_s: float = 60.0) -> None:
        """Until the agent's pod watch is open (it has listed and started its tasks)."""

        def up() -> bool:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise AssertionError(f"exited with {self.proc.returncode}:\n{self.log.read_text()}")
            return server.watching.is_set()

        await wait_for(up, timeout=timeout_s, interval=0.05, what="the agent's pod watch")

    async def exit_code(self, *, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout=timeout_s)

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    def lines(self) -> list[dict[str, Any]]:
        """The JSON log lines (anything else, a traceback, is left out)."""
        found = []
        for line in self.log.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
        return [entry for entry in found if isinstance(entry, dict)]


async def assert_sigterm_stops_cleanly(process: AgentProcess, server: FakeApiServer) -> None:
    """Once up, SIGTERM ends the agent with status 0, logging ``stopped`` and no dead task."""
    try:
        await process.wait_up(server)
        process.terminate()
        assert await process.exit_code() == 0, process.log.read_text()
    finally:
        await process.kill()
    events = [line["event"] for line in process.lines()]
    assert "stopped" in events
    assert DIED not in events


async def assert_dies_naming_the_task(
    process: AgentProcess, server: FakeApiServer, event: dict[str, Any], task: str
) -> None:
    """Started with ``INJECT_BUG``: the watch ``event`` kills its pod cache task, which ends the agent
    with status 1 and one log line naming ``task`` and the error."""
    try:
        await process.wait_up(server)
        server.send(event)
        assert await process.exit_code() == 1, process.log.read_text()
    finally:
        await process.kill()
    (died,) = [line for line in process.lines() if line["event"] == DIED]
    assert (died["level"], died["task"], died["error"]) == ("error", task, "TypeError: injected")
