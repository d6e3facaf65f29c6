"""A node agent (device plugin, monitor) run as its own process against a ``FakeKube`` served over
HTTP (``ServedKube``): how the process ends (SIGTERM, a background task that dies) without a
control plane. Shared by ``tests/unit/device_plugin`` and ``tests/unit/monitor``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fake_kube import ServedKube

from hamipy.devcluster import wait_for
from hamipy.kube.resources import pod_path

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

    async def wait_up(self, server: ServedKube, *, timeout_s: float = 60.0) -> None:
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


async def assert_sigterm_stops_cleanly(process: AgentProcess, server: ServedKube) -> None:
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
    process: AgentProcess, server: ServedKube, event: dict[str, Any], task: str
) -> None:
    """Started with ``INJECT_BUG``: the watch ``event`` kills its pod cache task, which ends the agent
    with status 1 and one log line naming ``task`` and the error."""
    try:
        await process.wait_up(server)
        server.kube.send(pod_path(), event)
        assert await process.exit_code() == 1, process.log.read_text()
    finally:
        await process.kill()
    (died,) = [line for line in process.lines() if line["event"] == DIED]
    assert (died["level"], died["task"], died["error"]) == ("error", task, "TypeError: injected")
