"""Filters that arrive before the extender's pod watch delivered their pod (kube-scheduler's own
watch of the same API server was faster): they wait for it, so each pod of a burst is reserved
before the next is filtered. Without that, a burst under spread bunched on the node that looked
emptiest, and under binpack a bind found the node its filter had chosen full ("pod no longer fits").

The extender runs whole (HTTP routes, informers, binder) over ``FakeKube``, whose pod watch is held
back until the test lets it go."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from builders import allocation, gpu, gpu_node, gpu_pod
from fake_kube import FakeKube, gone, path_of, watch_event

from hamipy.devcluster import wait_for
from hamipy.extender.model import PodUid
from hamipy.extender.scheduler import UNKNOWN_POD
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.protocol import keys
from hamipy.protocol.config import Config

PODS = "/api/v1/pods"
SETTINGS = ExtenderSettings(handshake_interval_s=0, requeue_interval_s=0, api_timeout_s=1.0)
SPREAD = {keys.NODE_SCHEDULER_POLICY: "spread"}


@dataclasses.dataclass
class Rig:
    kube: FakeKube
    server: ExtenderServer
    held: asyncio.Event
    """Set to let the pod watch deliver what the test scripted."""

    async def post(self, path: str, body: Any) -> Any:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.post(self.server.url + path, data=json.dumps(body).encode()) as resp,
        ):
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def filter(self, p: dict[str, Any], nodes: list[str]) -> str:
        """kube-scheduler's filter of ``p`` (its copy as the API server stores it) over ``nodes``."""
        stored = self.kube.pod(p["metadata"]["namespace"], p["metadata"]["name"])
        answer = await self.post("/filter", {"Pod": stored, "NodeNames": nodes})
        [chosen] = answer["NodeNames"]
        return str(chosen)

    async def bind(self, p: dict[str, Any], node_name: str) -> str:
        meta = p["metadata"]
        body = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"]}
        answer = await self.post("/bind", {**body, "Node": node_name})
        return str(answer["Error"])

    def sample(self, name: str, **labels: str) -> float:
        return self.server.telemetry.metrics.registry.get_sample_value(name, labels) or 0.0

    async def filtered_while_held(self, p: dict[str, Any], nodes: list[str]) -> str:
        """Filter ``p`` while the pod watch has not delivered it: the watch is let go once the
        filter was answered or waits for it."""
        answer = asyncio.create_task(self.filter(p, nodes))
        await wait_for(
            lambda: answer.done() or self.sample("hamipy_extender_watch_waiting") > 0,
            timeout=5,
            interval=0.005,
            what="the filter answered or waiting for the pod watch",
        )
        self.held.set()
        return await answer


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the fixture's FakeKube holds: ``nodes``, ``bound`` pods (in the pod watch's list) and
    ``pending`` pods, created after that list; once let go, the pod watch delivers them (``relist``:
    it expires instead, and the list after it holds them)."""

    nodes: list[dict[str, Any]]
    pending: list[dict[str, Any]]
    bound: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    settings: ExtenderSettings = SETTINGS
    relist: bool = False


@pytest.fixture
async def started(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    setup: Setup = request.param
    kube = FakeKube()
    for n in setup.nodes:
        kube.add(n)
    for p in setup.bound:
        kube.add(p)
    listed = asyncio.Event()
    held = asyncio.Event()
    # The list is answered as soon as it is asked (the hook only marks it): the pending pods are
    # created just after it, with newer resourceVersions than the list's, which the watch starts
    # from; the watch then holds until the test lets it deliver them.
    kube.on_request = lambda method, path, body: listed.set() if path == PODS else None
    kube.send(PODS, held)
    server = ExtenderServer(
        config=Config(), settings=setup.settings, telemetry=Telemetry.create(stream=io.StringIO()), api=kube
    )
    async with server:
        await asyncio.wait_for(listed.wait(), 5)
        kube.add(*setup.pending)
        created = [kube.get(path_of(p)) for p in setup.pending]
        kube.send(PODS, *([gone()] if setup.relist else [watch_event("ADDED", p) for p in created]))
        await server.wait_synced(5)
        yield Rig(kube, server, held)


def our(name: str, devices: list[Any]) -> dict[str, Any]:
    return gpu_node(name, devices, ours=True)


NODES = [f"n{i}" for i in range(4)]
BURST = [gpu_pod(f"p{i}", annotations=SPREAD) for i in range(4)]


EQUAL = [our(n, [gpu(f"GPU-{n}")]) for n in NODES]


@pytest.mark.parametrize("started", [Setup(EQUAL, BURST)], indirect=True)
async def test_a_spread_burst_filtered_ahead_of_the_watch_takes_one_node_each(started: Rig) -> None:
    chosen = [await started.filtered_while_held(BURST[0], NODES)]
    await wait_for(lambda: len(started.server.model.pending) == len(BURST), timeout=5, interval=0.005)
    chosen += [await started.filter(p, NODES) for p in BURST[1:]]
    assert sorted(chosen) == NODES  # no node took a second pod while an equal one had none
    held = started.server.model.contributions
    assert sorted(c.node for c in held.values() if c.source == "reserved") == NODES
    assert started.sample("hamipy_extender_watch_wait_seconds_count", result="reached") == 1


# Binpack (the default): node "a" has one slot left, so it is the fullest and comes first.
FULLEST = our("a", [gpu("GPU-a", count=2)])
EMPTY = our("b", [gpu("GPU-b", count=2)])
HOLDER = gpu_pod(
    "holder", node_name="a", phase="Running", annotations=allocation(allocated="GPU-a,NVIDIA,1000,0:;")
)
PAIR = [gpu_pod("q0"), gpu_pod("q1")]


@pytest.mark.parametrize("started", [Setup([FULLEST, EMPTY], PAIR, bound=[HOLDER])], indirect=True)
async def test_a_binpack_burst_filtered_ahead_of_the_watch_binds_where_it_was_filtered(
    started: Rig,
) -> None:
    first = await started.filtered_while_held(PAIR[0], ["a", "b"])
    await wait_for(lambda: len(started.server.model.pending) == len(PAIR), timeout=5, interval=0.005)
    second = await started.filter(PAIR[1], ["a", "b"])
    # Each bind takes the node its filter chose: none finds it full ("pod no longer fits").
    assert [await started.bind(p, n) for p, n in zip(PAIR, (first, second), strict=True)] == ["", ""]
    assert (first, second) == ("a", "b")
    refused = started.sample(
        "hamipy_extender_decisions_total", verb="bind", result="refused", reason="refused"
    )
    assert refused == 0


MADE_UP = gpu_pod("ghost", annotations=SPREAD)


@pytest.mark.parametrize("started", [Setup(EQUAL, [MADE_UP])], indirect=True)
async def test_a_pod_sent_without_a_version_or_one_the_watch_passed_waits_for_nothing(
    started: Rig,
) -> None:
    """A made-up pod with no resourceVersion, or the version of the list the watch started from
    (whatever it names, the watch has every change up to there): answered at once, the watch still
    held, and nothing reserved."""
    stored = started.kube.pod("ns", "ghost")
    for version in (None, "1"):
        copy = {**stored, "metadata": {**stored["metadata"], "resourceVersion": version}}
        answer = await started.post("/filter", {"Pod": copy, "NodeNames": NODES})
        assert answer["NodeNames"] == ["n0"]
    assert not started.held.is_set()
    assert started.server.model.contributions == {}
    assert (
        started.sample("hamipy_extender_decisions_total", verb="filter", result="fit", reason=UNKNOWN_POD)
        == 2
    )
    for result in ("reached", "timeout"):
        assert started.sample("hamipy_extender_watch_wait_seconds_count", result=result) == 0


ONE = [our("n0", [gpu("GPU-n0")])]


@pytest.mark.parametrize(
    "started",
    [Setup(ONE, [MADE_UP], settings=dataclasses.replace(SETTINGS, watch_wait_s=0.05))],
    indirect=True,
)
async def test_a_watch_that_never_delivers_the_pod_holds_the_filter_at_most_watch_wait(started: Rig) -> None:
    assert await started.filter(MADE_UP, ["n0"]) == "n0"
    assert started.server.model.contributions == {}  # answered as a pod the watch does not hold
    assert started.sample("hamipy_extender_watch_wait_seconds_count", result="timeout") == 1
    assert started.sample("hamipy_extender_watch_waiting") == 0


@pytest.mark.parametrize(
    "started", [Setup(ONE, [MADE_UP], settings=dataclasses.replace(SETTINGS, watch_wait_s=0))], indirect=True
)
async def test_no_wait_when_watch_wait_is_zero(started: Rig) -> None:
    assert await started.filter(MADE_UP, ["n0"]) == "n0"
    assert not started.held.is_set()
    assert started.sample("hamipy_extender_watch_wait_seconds_count", result="timeout") == 0


@pytest.mark.parametrize("started", [Setup(ONE, [MADE_UP], relist=True)], indirect=True)
async def test_a_relist_that_holds_the_pod_ends_the_wait(started: Rig) -> None:
    """The watch expires (410) instead of delivering the pod; the list after it holds the pod."""
    assert await started.filtered_while_held(MADE_UP, ["n0"]) == "n0"
    assert started.server.model.contributions[PodUid("uid-ns-ghost")].source == "reserved"
