"""The ``hamipy-monitor`` process against a fake API server: SIGTERM stops it with status 0; a
background task that dies ends it with status 1 and a log line naming the task."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from monitor_fakes import pod_json


def _load(relative: str) -> ModuleType:
    """A helper module of another test folder (``tests/unit/<relative>``), loaded once by path:
    test folders are not packages."""
    path = Path(__file__).resolve().parents[1] / relative
    name = "hamipy_tests_unit_" + relative.removesuffix(".py").replace("/", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_agents = _load("device_plugin/agent_process.py")  # shared with the device plugin's process tests
AgentProcess: Any = _agents.AgentProcess
FakeApiServer: Any = _agents.FakeApiServer
DIED: str = _agents.DIED
INJECT_BUG: str = _agents.INJECT_BUG

NODE = "gpu-node"
MODULE = "hamipy.monitor.cli"


@pytest.fixture
async def api() -> AsyncIterator[Any]:
    async with FakeApiServer(NODE, [pod_json("listed")]) as server:
        yield server


def monitor(api: Any, tmp_path: Path, *, python_args: list[str]) -> Any:
    args = [
        "--node-name",
        NODE,
        "--kubeconfig",
        str(api.kubeconfig(tmp_path / "kubeconfig")),
        "--hook-path",
        str(tmp_path / "vgpu"),
        "--no-host-metrics",
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        "0",
    ]
    return AgentProcess([*python_args, *args], log=tmp_path / "monitor.log")


async def test_sigterm_stops_the_monitor_with_status_0(api: Any, tmp_path: Path) -> None:
    process = await monitor(api, tmp_path, python_args=["-m", MODULE]).start()
    try:
        await process.wait_up(api)
        process.terminate()
        assert await process.exit_code() == 0, process.log.read_text()
    finally:
        await process.kill()
    events = [line["event"] for line in process.lines()]
    assert "stopped" in events
    assert DIED not in events


async def test_a_task_that_dies_ends_the_monitor_with_status_1(api: Any, tmp_path: Path) -> None:
    process = await monitor(api, tmp_path, python_args=["-c", INJECT_BUG, MODULE]).start()
    try:
        await process.wait_up(api)
        api.send({"type": "ADDED", "object": pod_json("new", resource_version="6")})
        assert await process.exit_code() == 1, process.log.read_text()
    finally:
        await process.kill()
    (died,) = [line for line in process.lines() if line["event"] == DIED]
    assert (died["level"], died["task"], died["error"]) == (
        "error",
        "monitor:pod-informer",
        "TypeError: injected",
    )
