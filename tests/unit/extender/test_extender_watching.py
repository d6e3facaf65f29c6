"""The model fed by its informers: a list replaces what the model knew of that resource (allocations
of pods deleted while no watch was open are forgotten, the others kept), each change applies one
object, restarts are counted, malformed annotations reported; and the handshake stamping."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

import pytest
from builders import gpu, gpu_node, gpu_pod, running_pod
from fake_kube import FakeKube, bookmark, gone, watch_event

from hamipy.devcluster import wait_for
from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.extender.watching import Resource, model_informers, stamp_once
from hamipy.kube.client import NullKube
from hamipy.kube.errors import KubeError
from hamipy.kube.events import EventRecorder
from hamipy.kube.informer import Informer
from hamipy.kube.resources import node_path, pod_path
from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice

SETTINGS = ExtenderSettings(api_timeout_s=1.0)
PODS = "/api/v1/pods"


class Rig:
    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.model = ClusterModel()
        self.telemetry = Telemetry.create(stream=io.StringIO())
        self.events = EventRecorder(NullKube(), component="hamipy-extender", logger=self.telemetry.logger)
        self.informers = model_informers(
            kube, model=self.model, settings=SETTINGS, telemetry=self.telemetry, events=self.events
        )

    def restarts(self, resource: Resource, cause: str) -> float:
        value = self.telemetry.metrics.registry.get_sample_value(
            "hamipy_extender_watch_restarts_total", {"resource": resource, "cause": cause}
        )
        return value or 0.0


@contextlib.asynccontextmanager
async def watching(informers: dict[Resource, Informer]) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(i.run(), name=f"watch-{r}") for r, i in informers.items()]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def until(condition: Callable[[], bool], what: str) -> None:
    await wait_for(lambda: True if condition() else None, timeout=5, interval=0.005, what=what)


def a_cluster() -> FakeKube:
    kube = FakeKube()
    kube.add(gpu_node("n", [gpu("A", 0, mem=10000)]))
    return kube


async def test_lists_then_applies_events_and_advances_on_bookmarks() -> None:
    kube = a_cluster()
    added = running_pod("a", allocated="A,NVIDIA,500,0:;", node="n")
    added["metadata"]["resourceVersion"] = "907"
    kube.send(PODS, watch_event("ADDED", added), bookmark(909), None)
    r = Rig(kube)
    async with watching(r.informers):
        await until(lambda: r.restarts("pods", "closed") == 1, "the scripted watch ended")
        assert r.model.synced
        assert r.model.contributions[PodUid("uid-ns-a")].source == "allocated"
        assert r.model.nodes[NodeName("n")].gpus[0].used_mem == 500
        assert r.informers["pods"].resource_version == "909"
        # The watch is re-opened from the bookmark's version.
        await until(lambda: len([w for w in kube.watches if w.path == PODS]) == 2, "the watch re-opened")
    assert [w.query for w in kube.watches if w.path == PODS][-1]["resourceVersion"] == "909"


@pytest.mark.parametrize(
    ("interruption", "cause"),
    [
        pytest.param(gone(), "gone", id="410-gone"),
        pytest.param(KubeError("WATCH /api/v1/pods: connection reset"), "error", id="connection-lost"),
    ],
)
async def test_a_relist_forgets_pods_deleted_while_not_watching_and_keeps_the_others(
    interruption: dict[str, object] | KubeError, cause: str
) -> None:
    kube = a_cluster()
    kube.add(running_pod("kept", allocated="A,NVIDIA,1000,0:;", node="n"))
    kube.add(running_pod("deleted", allocated="A,NVIDIA,3000,0:;", node="n"))
    resumed = asyncio.Event()
    kube.send(PODS, resumed, interruption)
    r = Rig(kube)
    async with watching(r.informers):
        await until(lambda: r.model.synced, "listed")
        # A filter's reservation is the extender's own: a list does not know of it.
        r.model.reserve(
            uid=PodUid("uid-ns-reserved"),
            namespace="ns",
            name="reserved",
            node=NodeName("n"),
            devices=[[ContainerDevice("A", "NVIDIA", 200, 0)]],
            n_init=0,
            expires_at=float("inf"),
        )
        assert r.model.nodes[NodeName("n")].gpus[0].used_mem == 4200
        kube.remove(pod_path("ns", "deleted"))  # its DELETED event is never seen: no watch is open
        resumed.set()
        await until(lambda: r.informers["pods"].lists == 2, "listed again")
    assert set(r.model.contributions) == {PodUid("uid-ns-kept"), PodUid("uid-ns-reserved")}
    assert r.model.contributions[PodUid("uid-ns-kept")].source == "allocated"
    assert r.model.nodes[NodeName("n")].gpus[0].used_mem == 1200
    assert r.restarts("pods", cause) == 1


async def test_a_deleted_event_frees_the_gpus() -> None:
    kube = a_cluster()
    kube.add(running_pod("a", allocated="A,NVIDIA,1000,0:;", node="n"))
    kube.send(PODS, watch_event("DELETED", kube.pod("ns", "a")), None)
    r = Rig(kube)
    async with watching(r.informers):
        await until(lambda: r.restarts("pods", "closed") == 1, "the scripted watch ended")
    assert r.model.contributions == {}
    assert r.model.nodes[NodeName("n")].gpus[0].used_mem == 0


async def test_malformed_annotations_are_logged_counted_and_reported_as_events() -> None:
    kube = a_cluster()
    kube.add(gpu_pod("bad", node_name="n", phase="Running", annotations={keys.DEVICES_ALLOCATED: "garbage"}))
    r = Rig(kube)
    async with watching(r.informers):
        await until(lambda: r.model.synced, "listed")
    assert r.model.nodes[NodeName("n")].bad_pods == {PodUid("uid-ns-bad")}
    assert [e.reason for e in r.events.recorded] == ["MalformedAnnotation"]
    sample = r.telemetry.metrics.registry.get_sample_value(
        "hamipy_extender_malformed_annotations_total", {"kind": "Pod", "field": keys.DEVICES_ALLOCATED}
    )
    assert sample == 1


async def test_handshake_stamped_only_where_needed() -> None:
    kube = FakeKube()
    kube.add(gpu_node("n"))
    kube.add(gpu_node("m", annotations={keys.NODE_HANDSHAKE: "Requesting_2025-01-01 00:00:00"}))
    r = Rig(kube)
    r.model.replace_nodes(kube.items(node_path()))
    stamped = await stamp_once(
        api=kube,
        model=r.model,
        settings=SETTINGS,
        telemetry=r.telemetry,
        now=datetime(2025, 6, 1, tzinfo=UTC),
    )
    assert stamped == 1
    assert kube.node("n")["metadata"]["annotations"][keys.NODE_HANDSHAKE] == "Requesting_2025-06-01 00:00:00"
