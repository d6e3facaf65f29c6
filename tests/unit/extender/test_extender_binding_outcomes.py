"""What a bind writes and what it refuses (docs/extender.md, "Bind and the node lock"): retried
binds, the fresh re-check of the node under the lock, the pod patch and the Binding under the
pod's UID, the refusals and their reasons, and the cleanup after a failure."""

from __future__ import annotations

import copy
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import builders
import pytest
from builders import container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, bind_rig

from hamipy.extender.errors import BindRefused
from hamipy.extender.invariant import check_cluster
from hamipy.extender.model import NodeName, PodUid
from hamipy.kube.errors import KubeError
from hamipy.kube.resources import pod_path
from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.node_handshake import requesting

POD_PATH = "/api/v1/namespaces/ns/pods/p"
NAME_63 = "gpu-" + "x" * 59
"""The longest node name a label value can hold."""
NAME_64 = "gpu-" + "x" * 25 + "." + "y" * 34
"""A node name one character too long for a label value (a valid DNS subdomain)."""


def pod_writes(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [call for call in calls if call == ("PATCH", POD_PATH)]


# -- retried binds ------------------------------------------------------------------------------------


async def test_a_retried_bind_of_a_pod_already_bound_there_succeeds_without_writing() -> None:
    r = bind_rig()
    r.kube.add(gpu_pod("p", node_name="n"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.calls == [("GET", POD_PATH)]


async def test_a_pod_bound_to_another_node_is_refused() -> None:
    r = bind_rig()
    r.kube.add(gpu_pod("p", node_name="m"))
    with pytest.raises(BindRefused, match="pod ns/p is already bound to m"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.calls == [("GET", POD_PATH)]


async def test_a_pod_asking_malformed_resources_is_refused() -> None:
    r = bind_rig()
    r.kube.add(gpu_pod("p", container(gpu="lots")))
    with pytest.raises(BindRefused, match=r"pod asks malformed resources: .*lots"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.lock() is None


# -- refusals: the node as the API has it now ---------------------------------------------------------


def _unusable(why: str) -> dict[str, Any]:
    if why == "malformed-register":
        return gpu_node("n", annotations={keys.NODE_REGISTER: "nonsense"})
    if why == "handshake":
        stamp = requesting(datetime.now(UTC) - timedelta(minutes=2))
        return builders.node(
            "n",
            [gpu("A", 0)],
            uid="uid-n",
            resource_version="1",
            annotations={keys.NODE_HANDSHAKE: stamp},
            allocatable={keys.RESOURCE_COUNT: "0"},
        )
    if why == "unregistered":
        return builders.node("n", uid="uid-n", resource_version="1")
    return gpu_node("n", [gpu("A", 0)])


@pytest.mark.parametrize(
    ("why", "reason"),
    [
        pytest.param("malformed-register", f"malformed {keys.NODE_REGISTER}", id="malformed-register"),
        pytest.param("bad-pod", f"a pod on it has a malformed {keys.DEVICES_ALLOCATED}", id="bad-pod"),
        pytest.param("handshake", "handshake timed out", id="handshake"),
        pytest.param("unregistered", f"no {keys.NODE_REGISTER} annotation", id="unregistered"),
    ],
)
async def test_a_node_that_cannot_take_gpu_pods_now_is_refused_with_why(why: str, reason: str) -> None:
    r = bind_rig(BIND_SETTINGS, _unusable(why))
    if why == "bad-pod":
        r.kube.add(gpu_pod("q", node_name="n", annotations={keys.DEVICES_ALLOCATED: "A,NVIDIA,lots,0:;"}))
    r.kube.add(gpu_pod("p"))
    with pytest.raises(BindRefused, match=f"^node n cannot take GPU pods now: {reason}"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert pod_writes(r.kube.calls) == [], "nothing was written, so nothing is cleaned up"
    assert r.lock() is None
    assert "uid-ns-p" not in r.model.contributions


async def test_a_refused_bind_leaves_the_pod_as_it_was() -> None:
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=1)]))
    r.kube.add(gpu_pod("q", node_name="n", annotations={keys.DEVICES_ALLOCATED: "A,NVIDIA,1000,0:;"}))
    r.kube.add(gpu_pod("p"))
    before = copy.deepcopy(r.kube.pod("ns", "p"))
    with pytest.raises(BindRefused, match=r"pod no longer fits node n: .*CardTimeSlicingExhausted"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p") == before
    assert pod_writes(r.kube.calls) == []


# -- the fresh re-check --------------------------------------------------------------------------------


@pytest.mark.parametrize("uuid", ["A", "B"])
async def test_the_filters_devices_are_kept_when_they_still_fit(uuid: str) -> None:
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0), gpu("B", 1)]))
    r.kube.add(gpu_pod("p"))
    r.model.reserve(
        uid=PodUid("uid-ns-p"),
        namespace="ns",
        name="p",
        node=NodeName("n"),
        devices=[[ContainerDevice(uuid, "NVIDIA", 1000, 0)]],
        n_init=0,
        expires_at=time.time() + 60,
    )
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert (
        r.kube.pod("ns", "p")["metadata"]["annotations"][keys.DEVICES_ALLOCATED] == f"{uuid},NVIDIA,1000,0:;"
    )


def mid_bind(name: str, node_name: str, *, bound: bool) -> dict[str, Any]:
    """A pod another replica allocated one slot of GPU A on ``node_name``: labelled, and
    ``bound`` or not yet (its Binding still to come)."""
    p = gpu_pod(
        name,
        node_name=node_name if bound else None,
        annotations={keys.VGPU_NODE: node_name, keys.DEVICES_ALLOCATED: "A,NVIDIA,1000,0:;"},
    )
    p["metadata"]["labels"] = {keys.VGPU_NODE_LABEL: node_name}
    return p


@pytest.mark.parametrize(("slots", "fits"), [(2, False), (3, True)], ids=["full", "one-left"])
async def test_the_re_check_counts_each_pod_bound_or_mid_bind_once(slots: int, fits: bool) -> None:
    # q is in both lists (bound and labelled), r only in the label list, after q. r is mid-bind
    # under a lock that expired (its binder stalled): the lock is broken and r counted as if bound.
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=slots)]))
    r.kube.add(mid_bind("q", "n", bound=True))
    r.kube.add(mid_bind("r", "n", bound=False))
    r.locked_by("ns", "r", datetime.now(UTC) - timedelta(minutes=10))
    r.kube.add(gpu_pod("p"))
    if fits:
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
        assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    else:
        with pytest.raises(BindRefused, match="pod no longer fits node n"):
            await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))


async def test_a_node_name_of_63_characters_is_written_as_label_and_read_by_it() -> None:
    r = bind_rig(BIND_SETTINGS, gpu_node(NAME_63, [gpu("A", 0, count=2)]))
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName(NAME_63))
    assert r.kube.pod("ns", "p")["metadata"]["labels"] == {keys.VGPU_NODE_LABEL: NAME_63}
    # A pod another replica is binding there (under the lock we break) is found by the label only.
    r.kube.add(mid_bind("r", NAME_63, bound=False))
    r.locked_by("ns", "r", datetime.now(UTC) - timedelta(minutes=10), node_name=NAME_63)
    r.kube.add(gpu_pod("s"))
    with pytest.raises(BindRefused, match="pod no longer fits"):
        await r.binder.bind(namespace="ns", name="s", uid=PodUid("uid-ns-s"), node=NodeName(NAME_63))


async def test_a_node_name_too_long_for_a_label_is_written_as_annotation_only() -> None:
    r = bind_rig(BIND_SETTINGS, gpu_node(NAME_64, [gpu("A", 0, count=2)]))
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName(NAME_64))
    stored = r.kube.pod("ns", "p")
    assert "labels" not in stored["metadata"]
    assert stored["metadata"]["annotations"][keys.VGPU_NODE] == NAME_64
    assert stored["spec"]["nodeName"] == NAME_64


# -- the Binding and the label, under the pod's UID ------------------------------------------------


@pytest.mark.parametrize(
    ("replaced_before", "bound"),
    [(("POST", f"{POD_PATH}/binding"), False), (("PATCH", POD_PATH), True)],
    ids=["binding", "label"],
)
async def test_a_pod_replaced_during_its_bind_is_never_touched(
    replaced_before: tuple[str, str], bound: bool
) -> None:
    # A StatefulSet's pod deleted and created again under the same name, then bound by someone else:
    # before our Binding (refused, nothing written) or between it and the label (left unlabelled).
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=2)]))
    r.kube.add(gpu_pod("p"))
    successor = gpu_pod(
        "p",
        node_name="m",
        annotations=builders.allocation(allocated="GPU-m-0,NVIDIA,1000,0:;", node="m", phase="allocating"),
    )
    successor["metadata"]["uid"] = "uid-successor"
    stored: list[dict[str, Any]] = []

    def replace(method: str, path: str, body: Any) -> None:
        if (method, path) == replaced_before and not stored:
            r.kube.remove(pod_path("ns", "p"))
            r.kube.add(successor)
            stored.append(copy.deepcopy(r.kube.pod("ns", "p")))

    r.kube.on_request = replace
    if bound:
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    else:
        with pytest.raises(BindRefused, match="replaced while being bound"):
            await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
        assert "uid-ns-p" not in r.model.contributions
    assert r.kube.pod("ns", "p") == stored[0]
    # Bound on HAMi's node, the lock is left for its device plugin's Allocate; refused, freed.
    lock = r.lock()
    assert (lock or "").endswith(",ns,p") if bound else lock is None


async def test_a_refused_binding_frees_what_the_bind_held() -> None:
    r = bind_rig()
    r.kube.add(gpu_pod("p"))

    def watch_then_fail(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/binding"):
            # The watch delivered the pod (not bound) before the Binding was refused.
            r.model.apply_pod("MODIFIED", copy.deepcopy(r.kube.pod("ns", "p")))
            assert r.model.contributions[PodUid("uid-ns-p")].source == "binding"
            raise KubeError("boom", status=403)

    r.kube.on_request = watch_then_fail
    with pytest.raises(KubeError, match="boom"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert "uid-ns-p" not in r.model.contributions
    assert keys.DEVICES_ALLOCATED not in r.kube.pod("ns", "p")["metadata"]["annotations"]
    assert r.lock() is None
    assert (await check_cluster(r.kube)).ok


async def test_the_re_check_counts_only_the_broken_locks_holder_among_unbound_pods() -> None:
    # r holds the expired lock mid-bind: counted. s is labelled and annotated for the node but not
    # bound and holds no lock (a bind that failed and could not clean up): not counted. One slot
    # left for p, so p fits only if s is not counted.
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=2)]))
    r.kube.add(mid_bind("r", "n", bound=False))
    r.kube.add(mid_bind("s", "n", bound=False))
    r.locked_by("ns", "r", datetime.now(UTC) - timedelta(minutes=10))
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"


async def test_the_broken_locks_holder_is_counted_with_its_init_containers_at_their_peak() -> None:
    # r (mid-bind under an expired lock) has an init container and an app container, each on one
    # slot of A: at its peak r holds one slot, so one of A's two is left for p.
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=2)]))
    holder = mid_bind("r", "n", bound=False)
    holder["spec"]["initContainers"] = [container("setup", gpu=1, gpumem=1000)]
    holder["metadata"]["annotations"][keys.DEVICES_ALLOCATED] = "A,NVIDIA,1000,0:;A,NVIDIA,1000,0:;"
    r.kube.add(holder)
    r.locked_by("ns", "r", datetime.now(UTC) - timedelta(minutes=10))
    r.kube.add(gpu_pod("p"))
    await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("n"))
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
