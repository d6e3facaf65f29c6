"""Two binds of one pod in flight at once (kube-scheduler retrying after its timeout while the first
bind still runs, or a leader hand-over between replicas): the bind that writes first wins, the other
leaves the pod exactly as the winner wrote it, and nothing loses its allocation.

Each bind reads the pod, decides, and writes the allocation with the Binding itself, guarded by the
pod's resourceVersion: a loser's write is a Conflict that changes nothing."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

import pytest
from builders import gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_rig, shared_rig

from hamipy.extender.binding import Binder
from hamipy.extender.errors import BindRefused
from hamipy.extender.invariant import check_cluster
from hamipy.extender.model import ClusterModel, PodUid
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.resources import node_path, pod_path
from hamipy.protocol import decode_pod_devices, keys
from hamipy.protocol.config import Config
from hamipy.protocol.identifiers import NodeName


def replica(r: BindRig) -> tuple[Binder, ClusterModel, Telemetry]:
    """A second extender replica over the same API: its own model, binder and metrics."""
    model = ClusterModel()
    model.replace_nodes(r.kube.items(node_path()))
    model.replace_pods(r.kube.items(pod_path()))
    telemetry = Telemetry.create()
    binder = Binder(api=r.kube, model=model, config=Config(), settings=BIND_SETTINGS, telemetry=telemetry)
    return binder, model, telemetry


def both_read_before_either_binds(r: BindRig) -> None:
    """Hold each Binding until two have been sent: both binds read the pod unbound and decided."""
    arrived: list[str] = []
    both = asyncio.Event()

    async def barrier(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/binding"):
            arrived.append(path)
            if len(arrived) == 2:
                both.set()
            await asyncio.wait_for(both.wait(), 2)

    r.kube.on_request = barrier


def races(telemetry: Telemetry) -> float:
    value = telemetry.metrics.registry.get_sample_value("hamipy_extender_bind_races_total")
    return 0.0 if value is None else value


async def test_two_binds_of_one_pod_on_one_node_bind_it_once_and_both_succeed() -> None:
    r = shared_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=4)]))
    r.kube.add(gpu_pod("p"))
    other, other_model, other_telemetry = replica(r)
    writes: list[dict[str, Any]] = []

    def record(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/binding"):
            writes.append(copy.deepcopy(body))

    r.kube.on_request = record
    await asyncio.gather(
        r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n")),
        other.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n")),
    )
    stored = r.kube.pod("ns", "p")
    assert stored["spec"]["nodeName"] == "n"
    # The pod carries the first bind's allocation, unchanged by the second.
    winner = writes[0]["metadata"]["annotations"]
    assert {k: stored["metadata"]["annotations"][k] for k in winner} == winner
    assert races(r.telemetry) + races(other_telemetry) == 1
    # Both replicas count the pod once, with what it holds.
    for model in (r.model, other_model):
        (held,) = model.contributions.values()
        assert held.raw == stored["metadata"]["annotations"][keys.DEVICES_ALLOCATED]
    assert r.lock() is None
    assert (await check_cluster(r.kube)).ok


async def test_two_binds_of_one_pod_on_two_nodes_bind_it_once_and_the_loser_leaves_it() -> None:
    r = shared_rig(
        BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=4)]), gpu_node("m", [gpu("B", 0, count=4)])
    )
    r.kube.add(gpu_pod("p"))
    other, other_model, other_telemetry = replica(r)
    both_read_before_either_binds(r)
    results = await asyncio.gather(
        r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n")),
        other.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("m")),
        return_exceptions=True,
    )
    stored = r.kube.pod("ns", "p")
    bound = stored["spec"]["nodeName"]
    (refusal,) = [res for res in results if isinstance(res, BaseException)]
    assert isinstance(refusal, BindRefused)
    assert f"was bound to {bound} by another bind meanwhile" in str(refusal)
    annotations = stored["metadata"]["annotations"]
    assert annotations[keys.VGPU_NODE] == bound
    (slot,) = decode_pod_devices(annotations[keys.DEVICES_ALLOCATED])
    assert [d.uuid for d in slot] == ["A" if bound == "n" else "B"]
    assert races(r.telemetry) + races(other_telemetry) == 1
    # The loser's model holds the winner's allocation on the winner's node, nothing on its own.
    for model in (r.model, other_model):
        (held,) = model.contributions.values()
        assert (held.node, held.raw) == (bound, annotations[keys.DEVICES_ALLOCATED])
    assert r.lock("n") is None
    assert r.lock("m") is None
    report = await check_cluster(r.kube)
    assert report.ok, report.violations


def meddle_once(r: BindRig, change: Callable[[], object]) -> None:
    """Make ``change`` just before the first Binding arrives (the pod changes under the bind)."""

    def hook(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/binding"):
            r.kube.on_request = None
            change()

    r.kube.on_request = hook


async def test_a_pod_deleted_under_a_bind_is_refused_and_nothing_is_left() -> None:
    r = bind_rig()
    r.kube.add(gpu_pod("p"))
    meddle_once(r, lambda: r.kube.remove(pod_path("ns", "p")))
    with pytest.raises(BindRefused, match="was deleted while being bound"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.model.contributions == {}
    assert r.lock() is None


async def test_a_pod_changed_otherwise_under_a_bind_is_read_again_and_bound() -> None:
    """A label written between the read and the Binding makes the Binding a Conflict; the pod is
    still the same unbound pod asking the same, so it is written again with its new version."""
    r = shared_rig()
    r.kube.add(gpu_pod("p"))
    meddle_once(r, lambda: r.kube.write(pod_path("ns", "p"), {"metadata": {"labels": {"team": "a"}}}))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    stored = r.kube.pod("ns", "p")
    assert stored["spec"]["nodeName"] == "n"
    assert stored["metadata"]["labels"]["team"] == "a"
    (slot,) = decode_pod_devices(stored["metadata"]["annotations"][keys.DEVICES_ALLOCATED])
    assert [d.uuid for d in slot] == ["A"]
    assert r.model.contributions[PodUid("uid-ns-p")].source == "allocated"
    assert r.lock() is None
