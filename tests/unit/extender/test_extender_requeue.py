"""Refused pods are retried once GPUs free (``hamipy.extender.requeue``): what the model reports as
freed, when the nudge is written, where, and how often."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from builders import container, gpu, gpu_node, gpu_pod
from extender_fakes import BindRig, bind_rig, filter_args
from fake_kube import FakeKube

from hamipy.devcluster import wait_for
from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.requeue import REFUSAL_TTL_S, Requeuer
from hamipy.extender.telemetry import Telemetry
from hamipy.extender.watching import ModelFeed
from hamipy.kube.client import NullKube
from hamipy.kube.errors import KubeError
from hamipy.kube.events import EventRecorder
from hamipy.kube.resources import node_path
from hamipy.protocol import keys


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def requeuer(kube: FakeKube, model: ClusterModel, *, interval_s: float = 1.0) -> tuple[Requeuer, Clock]:
    clock = Clock()
    r = Requeuer(
        api=kube,
        model=model,
        telemetry=Telemetry.create(),
        interval_s=interval_s,
        timeout_s=1.0,
        clock=clock,
    )
    model.on_freed = r.freed
    return r, clock


def nudged(kube: FakeKube, name: str) -> str | None:
    value: str | None = kube.node(name)["metadata"].get("annotations", {}).get(keys.REQUEUE)
    return value


def nudges(r: Requeuer, result: str) -> float:
    value = r.telemetry.metrics.registry.get_sample_value(
        "hamipy_extender_requeue_nudges_total", {"result": result}
    )
    return value or 0.0


def rig_with_waiting_pod() -> tuple[BindRig, Requeuer, Clock]:
    """Node ``n`` (one 32 GiB GPU) full with ``big`` (bound), and ``waits`` refused by a filter."""
    rig = bind_rig()
    r, clock = requeuer(rig.kube, rig.model)
    rig.scheduler.on_refused = r.refused
    big = gpu_pod("big", container(gpu=1, gpumem=30000), node_name="n")
    big["metadata"]["annotations"] = {keys.DEVICES_ALLOCATED: "A,NVIDIA,30000,0:;"}
    rig.add_watched_pod(big)
    waits = gpu_pod("waits", container(gpu=1, gpumem=8000))
    rig.add_watched_pod(waits)
    result = rig.scheduler.filter(filter_args(waits, ["n"]))
    assert result["NodeNames"] == []
    return rig, r, clock


async def test_a_pod_leaving_nudges_the_node_it_left_while_a_refused_pod_waits() -> None:
    rig, r, _ = rig_with_waiting_pod()
    assert r.waiting() == 1
    rig.model.apply_pod("DELETED", rig.kube.pod("ns", "big"))
    assert await r.nudge()
    assert nudged(rig.kube, "n") is not None
    assert nudges(r, "sent") == 1
    # Once written, the same release is not written again.
    assert not await r.nudge()
    assert nudges(r, "sent") == 1


async def test_nothing_is_written_while_no_refused_pod_waits() -> None:
    rig = bind_rig()
    r, _ = requeuer(rig.kube, rig.model)
    p = gpu_pod("p", node_name="n")
    p["metadata"]["annotations"] = {keys.DEVICES_ALLOCATED: "A,NVIDIA,1000,0:;"}
    rig.add_watched_pod(p)
    rig.model.apply_pod("DELETED", p)
    assert not await r.nudge()
    assert nudged(rig.kube, "n") is None
    assert ("PATCH", "/api/v1/nodes/n") not in rig.kube.calls


async def test_a_refused_pod_that_is_bound_or_gone_no_longer_counts() -> None:
    rig, r, _ = rig_with_waiting_pod()
    waits = rig.kube.pod("ns", "waits")
    rig.model.apply_pod("DELETED", waits)
    rig.model.apply_pod("DELETED", rig.kube.pod("ns", "big"))
    assert r.waiting() == 0
    assert not await r.nudge()
    assert nudged(rig.kube, "n") is None


async def test_a_refusal_is_forgotten_after_its_ttl() -> None:
    rig, r, clock = rig_with_waiting_pod()
    clock.now += REFUSAL_TTL_S + 1
    rig.model.apply_pod("DELETED", rig.kube.pod("ns", "big"))
    assert not await r.nudge()


async def test_a_failed_patch_is_counted_and_logged_not_raised() -> None:
    rig, r, _ = rig_with_waiting_pod()
    rig.kube.fail(KubeError("apiserver down", status=503), "PATCH", "/api/v1/nodes/n")
    rig.model.apply_pod("DELETED", rig.kube.pod("ns", "big"))
    assert not await r.nudge()
    assert nudges(r, "failed") == 1
    assert nudges(r, "sent") == 0


async def test_a_freed_node_the_model_no_longer_has_gives_way_to_one_it_has() -> None:
    kube = FakeKube()
    kube.add(gpu_node("m"))
    model = ClusterModel()
    model.replace_nodes(kube.items(node_path()))
    model.apply_pod("ADDED", gpu_pod("waits"))
    r, _ = requeuer(kube, model)
    r.refused(PodUid("uid-ns-waits"))
    r.freed(NodeName("gone"))
    assert r.target() == "m"
    assert await r.nudge()
    assert nudged(kube, "m") is not None


async def test_the_loop_writes_once_per_interval_however_much_frees() -> None:
    rig, r, _ = rig_with_waiting_pod()
    r.interval_s = 0.2
    written: list[float] = []

    def record(method: str, path: str, body: Any) -> None:
        if method == "PATCH" and path == "/api/v1/nodes/n":
            written.append(time.monotonic())

    rig.kube.on_request = record
    task = asyncio.create_task(r.run())
    try:
        r.freed(NodeName("n"))
        await wait_for(lambda: nudges(r, "sent") == 1, timeout=5, what="the first nudge")
        for _ in range(5):
            r.freed(NodeName("n"))  # within the interval: one more nudge covers them all
        await wait_for(lambda: nudges(r, "sent") == 2, timeout=5, what="the second nudge")
        assert not await r.nudge()  # the five were all covered by it
        assert len(written) == 2
        assert written[1] - written[0] >= r.interval_s  # the second waited out the interval
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# -- what the model reports as freed ---------------------------------------------------------


def recording(model: ClusterModel) -> list[NodeName | None]:
    freed: list[NodeName | None] = []
    model.on_freed = freed.append
    return freed


def test_the_model_reports_gpus_freed_by_a_pod_leaving_or_a_reservation_dropped() -> None:
    rig = bind_rig()
    freed = recording(rig.model)
    p = gpu_pod("p")
    rig.add_watched_pod(p)
    rig.scheduler.filter(filter_args(p, ["n"]))
    assert freed == []  # a reservation takes, it frees nothing
    rig.model.release(PodUid("uid-ns-p"))
    assert freed == ["n"]
    bound = gpu_pod("q", node_name="n")
    bound["metadata"]["annotations"] = {keys.DEVICES_ALLOCATED: "A,NVIDIA,1000,0:;"}
    rig.add_watched_pod(bound)
    assert freed == ["n"]
    bound["status"] = {"phase": "Succeeded"}
    rig.model.apply_pod("MODIFIED", bound)
    assert freed == ["n", "n"]


def test_a_node_registering_gpus_anew_is_freed_but_its_heartbeats_are_not() -> None:
    kube = FakeKube()
    kube.add(gpu_node("n", [gpu("A", 0)]))
    model = ClusterModel()
    model.replace_nodes(kube.items(node_path()))
    freed = recording(model)
    kube.write(node_path("n"), {"metadata": {"annotations": {keys.REQUEUE: "2026-11-24T00:00:00+00:00"}}})
    model.apply_node("MODIFIED", kube.node("n"))
    assert freed == []  # our own nudge comes back as a node event: it must not nudge again
    grown = gpu_node("n", [gpu("A", 0), gpu("B", 1)])
    model.apply_node("MODIFIED", grown)
    assert freed == ["n"]


def quota(hard: dict[str, str], *, used: str = "0") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "gpu", "uid": "q1"},
        "spec": {"hard": hard},
        "status": {"used": {"limits.nvidia.com/gpumem": used}},
    }


def test_a_quota_limit_changed_is_freed_but_its_status_updates_are_not() -> None:
    model = ClusterModel()
    freed = recording(model)
    telemetry = Telemetry.create()
    events = EventRecorder(NullKube(), component="hamipy-extender", logger=telemetry.logger)
    feed = ModelFeed("resourcequotas", model=model, telemetry=telemetry, events=events)
    feed.listed([quota({"limits.nvidia.com/gpumem": "8192"})])
    assert freed == [None]
    feed.changed("MODIFIED", quota({"limits.nvidia.com/gpumem": "8192"}, used="4096"))
    assert freed == [None]
    feed.changed("MODIFIED", quota({"limits.nvidia.com/gpumem": "16384"}, used="4096"))
    assert freed == [None, None]
    feed.changed("DELETED", quota({"limits.nvidia.com/gpumem": "16384"}))
    assert freed == [None, None, None]
