"""A background task that dies is never hidden: it is logged by name, ``/readyz`` fails with the
reason, ``/filter``, ``/prioritize`` and ``/bind`` refuse to decide from a model no longer kept
current, and ``serve`` ends with exit status 1. SIGTERM still ends it with 0."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import os
import signal
from typing import Any

import aiohttp
import pytest
from builders import gpu, gpu_node, gpu_pod
from fake_kube import FakeKube

import hamipy.extender.cli as cli
from hamipy.devcluster import wait_for
from hamipy.extender.errors import ExtenderError
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.options import EXIT_FAILED
from hamipy.protocol.config import Config
from hamipy.protocol.settings import settings_from

PODS = "/api/v1/pods"
BUG = TypeError("'NoneType' object is not subscriptable")


def extender(kube: FakeKube, log: io.StringIO) -> ExtenderServer:
    kube.add(gpu_node("n", [gpu("A", 0)]))
    return ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(handshake_interval_s=0, api_timeout_s=1.0),
        telemetry=Telemetry.create(stream=log),
        api=kube,
    )


def broken_pod_watch() -> FakeKube:
    """An API whose pod watch stream raises what no Kubernetes error handler catches."""
    kube = FakeKube()
    kube.send(PODS, BUG)
    return kube


def log_lines(log: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.getvalue().splitlines()]


async def call(srv: ExtenderServer, method: str, path: str, body: Any = None) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.request(method, srv.url + path, json=body) as resp,
    ):
        return resp.status, await resp.text()


async def test_a_dead_watch_is_logged_fails_readiness_and_refuses_decisions() -> None:
    log = io.StringIO()
    kube = broken_pod_watch()
    async with extender(kube, log) as srv:
        await asyncio.wait_for(srv.supervisor.failed.wait(), timeout=5)
        assert srv.model.synced, "both lists went through: only the watch died"

        [died] = [line for line in log_lines(log) if line["event"].startswith("background task died")]
        assert died["task"] == "extender-watch-pods"
        assert "TypeError" in died["error"]

        status, text = await call(srv, "GET", "/readyz")
        assert status == 503
        assert "task extender-watch-pods died: TypeError" in text

        p = gpu_pod("p")
        kube.add(p)
        for path, body in [
            ("/filter", {"Pod": p, "NodeNames": ["n"]}),
            ("/prioritize", {"Pod": p, "NodeNames": ["n"]}),
            ("/bind", {"PodName": "p", "PodNamespace": "ns", "PodUID": "uid-ns-p", "Node": "n"}),
        ]:
            status, text = await call(srv, "POST", path, body)
            assert status == 503, path
            error = json.loads(text)["Error"]
            assert "no longer kept current: task extender-watch-pods died" in error, path
        assert srv.model.contributions == {}, "nothing reserved from the stale model"
        assert not [c for c in kube.calls if c[0] != "GET"], "nothing written"
        refused = srv.telemetry.metrics.registry.get_sample_value(
            "hamipy_extender_decisions_total",
            {"verb": "filter", "result": "unavailable", "reason": "BackgroundTaskDied"},
        )
        assert refused == 1
        assert (await call(srv, "GET", "/healthz"))[0] == 200, "the process itself still serves"


async def test_wait_synced_reports_a_task_that_died() -> None:
    kube = FakeKube()
    kube.fail(TypeError("not a KubeError"), "GET", "/api/v1/nodes")
    async with extender(kube, io.StringIO()) as srv:
        with pytest.raises(ExtenderError, match="extender-watch-nodes died: TypeError"):
            await srv.wait_synced(5)


async def test_serve_exits_1_when_a_background_task_dies() -> None:
    log = io.StringIO()
    srv = extender(broken_pod_watch(), log)
    assert await asyncio.wait_for(cli.serve(srv), timeout=10) == EXIT_FAILED
    events = [(line["event"], line.get("task")) for line in log_lines(log)]
    assert ("background task died; the service stops", "extender-watch-pods") in events
    assert ("stopping: a background task died", None) in events
    assert srv.health.stopping.is_set()


async def test_sigterm_ends_serve_with_exit_0() -> None:
    log = io.StringIO()
    srv = extender(FakeKube(), log)
    serving = asyncio.create_task(cli.serve(srv), name="serve")
    await wait_for(lambda: srv.health.not_ready() is None or None, timeout=5, interval=0.01, what="ready")
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(serving, timeout=10) == 0
    assert srv.supervisor.failure is None
    assert "stopping on signal" in [line["event"] for line in log_lines(log)]


@pytest.mark.parametrize(("interval_s", "trimming"), [(60.0, True), (0.0, False)])
async def test_the_heap_is_trimmed_under_supervision_unless_switched_off(
    interval_s: float, trimming: bool
) -> None:
    kube = FakeKube()
    kube.add(gpu_node("n", [gpu("A", 0)]))
    srv = ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(handshake_interval_s=0, api_timeout_s=1.0, heap_trim_interval_s=interval_s),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=kube,
    )
    async with srv:
        assert ("extender-heap-trim" in srv.supervisor.tasks) is trimming
        assert srv.supervisor.failure is None


def test_the_heap_trim_interval_comes_from_the_flag_and_the_environment() -> None:
    args = cli.build_parser({"HAMIPY_EXTENDER_HEAP_TRIM_INTERVAL": "5"}).parse_args(["serve"])
    assert settings_from(ExtenderSettings, args).heap_trim_interval_s == 5
    args = cli.build_parser({}).parse_args(["serve", "--heap-trim-interval", "0"])
    assert settings_from(ExtenderSettings, args).heap_trim_interval_s == 0
    assert (
        settings_from(ExtenderSettings, cli.build_parser({}).parse_args(["serve"])).heap_trim_interval_s == 60
    )


async def test_the_collectors_pauses_are_served_while_the_extender_runs() -> None:
    srv = extender(FakeKube(), io.StringIO())
    pauses = srv.telemetry.metrics.gc_pauses
    async with srv:
        assert pauses in gc.callbacks
        gc.collect(2)
        status, text = await call(srv, "GET", "/metrics")
    assert status == 200
    assert pauses not in gc.callbacks
    full = [
        line
        for line in text.splitlines()
        if line.startswith('hamipy_extender_gc_pause_seconds_count{generation="2"}')
    ]
    assert len(full) == 1
    assert float(full[0].split()[-1]) >= 1
