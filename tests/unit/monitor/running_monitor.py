"""A monitor running in the test's process over a fake API, a temporary hook directory and fake
GPUs (the ``start_monitor`` fixture, in conftest.py), and how the tests read its /metrics."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from fake_kube import FakeKube
from monitor_fakes import GPU_A, FakeHostGpus
from prometheus_client.parser import text_string_to_metric_families

from hamipy.monitor.monitor import Monitor
from hamipy.monitor.telemetry import Telemetry

NODE = "gpu-node"
PODS = "/api/v1/pods"
ON_NODE = f"spec.nodeName={NODE}"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Running:
    monitor: Monitor
    api: FakeKube
    telemetry: Telemetry
    log: io.StringIO
    hook: Path
    gpus: FakeHostGpus | None
    clock: list[float] = field(default_factory=lambda: [1000.0])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.monitor.metrics_port}"

    async def get(self, path: str) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(self.url + path) as resp,
        ):
            return resp.status, await resp.text()

    async def scrape(self) -> Samples:
        status, body = await self.get("/metrics")
        assert status == 200
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body)
            for s in family.samples
        }


Start = Callable[..., Any]


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


def vgpu(pod: str, container: str, index: int = 0, uuid: str = GPU_A, ns: str = "ns") -> dict[str, str]:
    return {
        "namespace": ns,
        "pod": pod,
        "container": container,
        "vdevice_index": str(index),
        "device_uuid": uuid,
    }
