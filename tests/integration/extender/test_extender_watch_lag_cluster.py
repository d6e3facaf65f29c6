"""Bursts through the real kube-scheduler right after the extender started, with the extender's pod
watch behind kube-scheduler's (both watch the real API server; the extender's hands each event on
half a second late, as a watch does behind a busy event loop). kube-scheduler then filters every
pod of the burst before the extender's watch has it.

Under spread, each pod still goes to a node with none while one is left (no bunching on the node
that looks emptiest); under binpack, no bind is refused because the node its filter chose is full
("pod no longer fits node").
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body
from stack_support import EXTENDER_SETTINGS, use_extender

from hamipy.devcluster import API_TIMEOUT_S, wait_for
from hamipy.extender.server import ExtenderServer
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import Query, RawKube
from hamipy.protocol import keys
from hamipy.protocol.config import Config

pytestmark = pytest.mark.integration

LAG_S = 0.5
"""How late the extender's pod watch hands on each event."""
PODS = "/api/v1/pods"


class LaggingPodWatch(RawKube):
    """The real API server, whose pod watch hands on each event ``lag_s`` after it arrived (a watch
    behind, not a slower one: events keep their pace)."""

    def __init__(self, api_client: Any, lag_s: float) -> None:
        super().__init__(api_client)
        self.lag_s = lag_s

    async def stream(self, path: str, *, query: Query, inactivity_s: float) -> AsyncIterator[dict[str, Any]]:
        events = super().stream(path, query=query, inactivity_s=inactivity_s)
        if path != PODS:
            async for event in events:
                yield event
            return
        arrived: asyncio.Queue[tuple[float, dict[str, Any]] | BaseException | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for event in events:
                    arrived.put_nowait((time.monotonic(), event))
            except Exception as exc:  # handed on in its turn, as the stream would raise it
                arrived.put_nowait(exc)
            else:
                arrived.put_nowait(None)

        reader = asyncio.create_task(read(), name="lagging-pod-watch")
        try:
            while (item := await arrived.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                at, event = item
                await asyncio.sleep(max(0.0, at + self.lag_s - time.monotonic()))  # the lag itself
                yield event
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


@pytest.fixture
async def lagging_extender(
    kube_client: Any, hami_scheduler: Callable[..., Any]
) -> AsyncIterator[ExtenderServer]:
    """One extender whose pod watch is ``LAG_S`` behind, synced and wired into the hami-scheduler."""
    server = ExtenderServer(
        config=Config(),
        settings=EXTENDER_SETTINGS,
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=LaggingPodWatch(kube_client, LAG_S),
    )
    await server.start()
    try:
        await server.wait_synced(30)
        await use_extender(hami_scheduler, server.url)
        yield server
    finally:
        await server.stop()


async def burst(cluster: Cluster, count: int, annotations: dict[str, str] | None = None) -> dict[str, str]:
    """``count`` pods created at once; each pod's node once all are bound."""
    ns = cluster.namespace
    await asyncio.gather(
        *(
            cluster.create(
                pod_body(f"p{i}", container(gpu=1, gpumem=1000), selector=ns, annotations=annotations)
            )
            for i in range(count)
        )
    )

    async def placed() -> dict[str, str] | None:
        pods = await cluster.core.list_namespaced_pod(ns, _request_timeout=API_TIMEOUT_S)
        nodes = {p.metadata.name: p.spec.node_name for p in pods.items if p.spec.node_name}
        return nodes if len(nodes) == count else None

    found = await wait_for(placed, timeout=90, interval=0.5, what=f"{count} pods bound")
    assert found is not None
    return found


def refused_binds(server: ExtenderServer) -> float:
    registry = server.telemetry.metrics.registry
    labels = {"verb": "bind", "result": "refused", "reason": "refused"}
    return registry.get_sample_value("hamipy_extender_decisions_total", labels) or 0.0


@pytest.mark.timeout(180)
async def test_a_spread_burst_ahead_of_the_watch_puts_one_pod_on_each_node(
    cluster: Cluster, lagging_extender: ExtenderServer
) -> None:
    nodes = [await cluster.add_node(f"n{i}", [gpu(f"GPU-{cluster.namespace}-{i}")]) for i in range(6)]
    placed = await burst(cluster, len(nodes), {keys.NODE_SCHEDULER_POLICY: "spread"})
    # kube-scheduler sent every node each time: none may take a second pod while one has none.
    assert sorted(Counter(placed.values()).values()) == [1] * len(nodes), placed
    await cluster.assert_invariant()


@pytest.mark.timeout(180)
async def test_a_binpack_burst_ahead_of_the_watch_has_no_bind_refused(
    cluster: Cluster, lagging_extender: ExtenderServer
) -> None:
    ns = cluster.namespace
    for i in range(2):
        await cluster.add_node(f"n{i}", [gpu(f"GPU-{ns}-{i}", count=3)])
    placed = await burst(cluster, 6)  # binpack (the default) fills both nodes exactly
    assert sorted(Counter(placed.values()).values()) == [3, 3]
    assert refused_binds(lagging_extender) == 0
    await cluster.assert_invariant()
