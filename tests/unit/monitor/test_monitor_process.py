"""The ``hamipy-monitor`` process against a fake API server: SIGTERM stops it with status 0; a
background task that dies ends it with status 1 and a log line naming the task."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_process import INJECT_BUG, AgentProcess, assert_dies_naming_the_task, assert_sigterm_stops_cleanly
from builders import running_pod
from fake_kube import FakeKube, ServedKube, watch_event

NODE = "gpu-node"
MODULE = "hamipy.monitor.cli"


@pytest.fixture
async def api() -> AsyncIterator[ServedKube]:
    async with ServedKube(FakeKube(running_pod("listed"))) as server:
        yield server


def monitor(api: ServedKube, tmp_path: Path, *, python_args: list[str]) -> AgentProcess:
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


async def test_sigterm_stops_the_monitor_with_status_0(api: ServedKube, tmp_path: Path) -> None:
    await assert_sigterm_stops_cleanly(await monitor(api, tmp_path, python_args=["-m", MODULE]).start(), api)


async def test_a_task_that_dies_ends_the_monitor_with_status_1(api: ServedKube, tmp_path: Path) -> None:
    process = await monitor(api, tmp_path, python_args=["-c", INJECT_BUG, MODULE]).start()
    event = watch_event("ADDED", running_pod("new", resource_version="906"))
    await assert_dies_naming_the_task(process, api, event, "monitor:pod-informer")
