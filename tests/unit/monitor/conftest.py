"""The monitor's unit tests' fixtures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from monitor_fakes import FakeHostGpus, telemetry
from running_monitor import NODE, ON_NODE, PODS, Running, Start

from hamipy.devcluster import wait_for
from hamipy.monitor.monitor import Monitor
from hamipy.monitor.settings import MonitorSettings


@pytest.fixture
async def start_monitor(tmp_path: Path) -> AsyncIterator[Start]:
    """start_monitor(pods=[...], **settings) -> Running, stopped after the test."""
    stops: list[tuple[asyncio.Event, asyncio.Task[str | None]]] = []
    apis: list[FakeKube] = []

    async def start(
        pods: list[dict[str, Any]] | None = None, *, gpus: FakeHostGpus | None = None, **settings: Any
    ) -> Running:
        hook = tmp_path / "vgpu"
        hook.mkdir(exist_ok=True)
        t, stream = telemetry()
        api = FakeKube(*(pods or []))
        apis.append(api)
        clock = [1000.0]
        values = {"metrics_host": "127.0.0.1", "metrics_port": 0, "feedback_interval_s": 3600.0, **settings}
        monitor = Monitor(
            settings=MonitorSettings(node_name=NODE, hook_path=hook, **values),
            telemetry=t,
            api=api,
            host_gpus=gpus,
            wall_clock=lambda: 1_750_000_000.0,
            monotonic=lambda: clock[0],
        )
        stop = asyncio.Event()
        task = asyncio.create_task(monitor.run(stop), name="test:monitor")
        stops.append((stop, task))
        await wait_for(lambda: monitor.metrics_port is not None and monitor.pods.synced.is_set(), timeout=10)
        return Running(monitor, api, t, stream, hook, gpus, clock)

    yield start
    for stop, task in stops:
        stop.set()
        assert await asyncio.wait_for(task, timeout=10) is None, "stopped, no task died"
    for api in apis:
        asked = {(r.method, r.path, r.query.get("fieldSelector")) for r in [*api.requests, *api.watches]}
        assert asked == {("GET", PODS, ON_NODE), ("WATCH", PODS, ON_NODE)}, "only its node's pods, only read"
