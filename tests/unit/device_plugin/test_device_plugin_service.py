"""A device plugin in this process over a fake API, a fake kubelet and fake GPUs: readiness, and a
background task that dies (a bug in the pod watch, the health thread): logged by name, ``/readyz``
503 with the reason, ``run`` ending with it; a stop ends it cleanly."""

from __future__ import annotations

import asyncio
import io
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from plugin_fakes import GPU_A, NODE, FakeHealth, FakeKube, FakeKubelet, log_lines

from hamipy.devcluster import wait_for
from hamipy.device_plugin.plugin import DevicePlugin
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.protocol import keys
from hamipy.protocol.config import load_config

DIED = "background task died; the service stops"


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Not tmp_path: a unix socket's path must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="hdp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Plugin:
    plugin: DevicePlugin
    api: FakeKube
    log: io.StringIO
    health: list[FakeHealth]

    async def readyz(self) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.plugin.metrics_port}/readyz"
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(url) as resp,
        ):
            return resp.status, await resp.text()

    def died(self) -> list[dict[str, Any]]:
        return [e for e in log_lines(self.log) if e["event"] == DIED]


@pytest.fixture
def make_plugin(plugin_dir: Path, tmp_path: Path) -> Callable[..., Plugin]:
    def make(*, health_fails: BaseException | None = None) -> Plugin:
        log = io.StringIO()
        api = FakeKube()
        made: list[FakeHealth] = []

        def health_watch(
            uuids: list[str], on_unhealthy: Callable[[str, str], None], *, poll_s: float
        ) -> FakeHealth:
            watch = FakeHealth(uuids, on_unhealthy, poll_s=poll_s)
            watch.fail = health_fails
            made.append(watch)
            return watch

        plugin = DevicePlugin(
            config=load_config(f"nvidia:\n  hookPath: {tmp_path}/vgpu\n"),
            settings=PluginSettings(
                node_name=NODE,
                plugin_dir=plugin_dir,
                metrics_host="127.0.0.1",
                metrics_port=0,
                socket_check_interval_s=0.05,
            ),
            telemetry=Telemetry.create(stream=log),
            api=api,
            discover=lambda: [GPU_A],
            health_watch=health_watch,
        )
        return Plugin(plugin, api, log, made)

    return make


@pytest.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[FakeKubelet]:
    async with FakeKubelet(plugin_dir) as k:
        yield k


async def ready(p: Plugin) -> None:
    await wait_for(lambda: p.plugin.metrics_port is not None and p.plugin.not_ready() is None, timeout=10)


async def test_ready_once_registered_with_the_kubelet_and_the_node_and_pods_listed(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    p = make_plugin()
    async with p.plugin.running():
        await ready(p)
        assert await p.readyz() == (200, "ok")
        assert [r.resource_name for r in kubelet.registration.requests] == ["nvidia.com/gpu"]
        assert keys.NODE_REGISTER in p.api.node["metadata"]["annotations"]
        assert (plugin_dir / "hamipy-nvidia.sock").exists()
    assert not (plugin_dir / "hamipy-nvidia.sock").exists(), "stopping removes the socket"
    assert p.died() == []


async def test_not_ready_says_what_it_waits_for(make_plugin: Callable[..., Plugin]) -> None:
    p = make_plugin()  # no kubelet: registration is retried
    async with p.plugin.running():
        await wait_for(lambda: p.plugin.pods.synced.is_set() and p.plugin.node_written.is_set(), timeout=10)
        assert await p.readyz() == (503, "not registered with the kubelet")


async def test_a_bug_in_the_pod_watch_fails_readiness_with_the_reason(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet
) -> None:
    p = make_plugin()
    async with p.plugin.running():
        await ready(p)
        p.api.events.put_nowait(TypeError("'NoneType' object is not subscriptable"))
        await asyncio.wait_for(p.plugin.supervisor.failed.wait(), timeout=10)
        reason = "task device-plugin:pod-informer died: TypeError: 'NoneType' object is not subscriptable"
        assert await p.readyz() == (503, reason)
    (line,) = p.died()
    assert (line["level"], line["task"]) == ("error", "device-plugin:pod-informer")
    assert line["error"] == "TypeError: 'NoneType' object is not subscriptable"


async def test_a_dead_task_ends_the_run_with_its_reason(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    p = make_plugin()
    p.api.events.put_nowait(TypeError("injected"))
    failure = await asyncio.wait_for(p.plugin.run(asyncio.Event()), timeout=10)
    assert failure == "task device-plugin:pod-informer died: TypeError: injected"
    assert [line["task"] for line in p.died()] == ["device-plugin:pod-informer"]
    assert not (plugin_dir / "hamipy-nvidia.sock").exists(), "the other tasks were stopped"
    assert p.health[0].stopped.is_set(), "the health thread was stopped"


async def test_a_health_thread_that_raises_ends_the_run(make_plugin: Callable[..., Plugin]) -> None:
    p = make_plugin(health_fails=RuntimeError("NVML handle went away"))
    failure = await asyncio.wait_for(p.plugin.run(asyncio.Event()), timeout=10)
    assert failure == "task device-plugin:health-watch died: RuntimeError: NVML handle went away"


async def test_stop_ends_the_run_without_a_failure(
    make_plugin: Callable[..., Plugin], kubelet: FakeKubelet
) -> None:
    p = make_plugin()
    stop = asyncio.Event()
    run = asyncio.create_task(p.plugin.run(stop), name="test:plugin")
    await ready(p)
    stop.set()
    assert await asyncio.wait_for(run, timeout=10) is None
    assert p.died() == []
    assert p.health[0].stopped.is_set()
