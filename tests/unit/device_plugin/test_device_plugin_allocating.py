"""Which pod and container an Allocate is for (allocating.choose): among the waiting pods bound to
the node, the one the kubelet's PodResources view says it is admitting, whose next container holds
no devices yet; never the order the pods were bound."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import builders
import pytest
from plugin_fakes import HELD, kubelet_view

from hamipy.device_plugin.allocating import Choice, KubeletPod, KubeletPods, choose, pending_pods
from hamipy.protocol import ContainerDevice, decode_pod_devices, keys

NODE = "gpu-node-1"
DEV_A = "GPU-A,NVIDIA,2000,30:"
DEV_B = "GPU-B,NVIDIA,1000,0:"


def pod(
    name: str,
    to_allocate: str | None,
    *,
    bind_time: int = 100,
    phase: str = "allocating",
    init: tuple[str, ...] = (),
    containers: tuple[str, ...] = ("main",),
    node: str = NODE,
) -> dict[str, Any]:
    """``builders.allocating_pod``: bound to ``node`` with ``to_allocate`` (``None``: no
    annotation) left to serve, each container asking for what its slot holds."""
    return builders.allocating_pod(
        name, *containers, node=node, to_allocate=to_allocate, init=init, phase=phase, bind_time=bind_time
    )


def listed(*pods: dict[str, Any], held: Mapping[str, frozenset[str]] | None = None) -> KubeletPods:
    """A kubelet listing every one of ``pods`` as being admitted: each container without devices,
    or with ``held`` (container name -> device IDs)."""
    out = {}
    for p in pods:
        names = [c["name"] for kind in ("initContainers", "containers") for c in p["spec"].get(kind) or ()]
        devices = {name: (held or {}).get(name, frozenset()) for name in names}
        out[("ns", p["metadata"]["name"])] = KubeletPod("ns", p["metadata"]["name"], devices)
    return out


def served_name(pods: list[dict[str, Any]], kubelet: KubeletPods, count: int = 1) -> str | None:
    served = choose(pods, node=NODE, device_count=count, kubelet=kubelet).served
    return None if served is None else served.name


# --- what decides: the kubelet's view ---------------------------------------------------------------


def test_the_pod_the_kubelet_admits_is_served_not_the_first_bound() -> None:
    pods = [pod("late", f"{DEV_A};", bind_time=200), pod("early", f"{DEV_B};", bind_time=100)]
    # A kubelet admitting in bind order reaches "early" first; one admitting in another order (after
    # a restart: creation order) is admitting "late", and "early" is not listed yet.
    assert served_name(pods, kubelet_view(pods, node=NODE)) == "early"
    served = choose(
        pods, node=NODE, device_count=1, kubelet=kubelet_view(pods, node=NODE, order=["late"])
    ).served
    assert served is not None
    assert (served.name, served.container, served.slot) == ("late", "main", 0)
    assert served.devices == [ContainerDevice("GPU-A", "NVIDIA", 2000, 30)]
    assert served.done
    assert served.to_allocate == ";"


@pytest.mark.parametrize("admitted", ["first", "second"])
def test_pods_bound_in_the_same_second_are_told_apart_by_the_kubelets_view(admitted: str) -> None:
    pods = [pod("second", f"{DEV_A};", bind_time=100), pod("first", f"{DEV_B};", bind_time=100)]
    assert served_name(pods, kubelet_view(pods, node=NODE, order=[admitted])) == admitted


INT64_MAX = 2**63 - 1
"""The largest bind-time a Go writer (``time.Unix()``, an int64) can stamp."""


@pytest.mark.parametrize(
    "stamp",
    [None, "", "soon", "-5", "1.5", "²"],
    ids=["absent", "empty", "word", "negative", "fraction", "superscript-digit"],
)
@pytest.mark.parametrize("stamped", [1_750_000_000, INT64_MAX], ids=["now", "int64-max"])
def test_the_bind_stamp_plays_no_part(stamp: str | None, stamped: int) -> None:
    unreadable = pod("a-unstamped", f"{DEV_A};")
    del unreadable["metadata"]["annotations"][keys.BIND_TIME]
    if stamp is not None:
        unreadable["metadata"]["annotations"][keys.BIND_TIME] = stamp
    pods = [unreadable, pod("z-stamped", f"{DEV_B};", bind_time=stamped)]
    for admitted in ("a-unstamped", "z-stamped"):
        assert served_name(pods, listed(*(p for p in pods if p["metadata"]["name"] == admitted))) == admitted


def test_a_pod_the_kubelet_does_not_list_is_never_served() -> None:
    # Not reached yet, or rejected (the kubelet failed its admission; the pod still says
    # "allocating" until its status lands): whatever its bind time, it is not the one admitted.
    pods = [pod("rejected", f"{DEV_A};", bind_time=1), pod("admitted", f"{DEV_B};", bind_time=2)]
    assert served_name(pods, listed(pods[1])) == "admitted"
    assert choose(pods, node=NODE, device_count=1, kubelet={}) == Choice(served=None, broken=[])


def test_a_container_the_kubelet_holds_devices_for_is_not_in_line() -> None:
    # "held" was allocated already in the kubelet's view (its slot was not emptied: the plugin's
    # write was lost); the kubelet is admitting "next", listed beside it.
    pods = [pod("held", f"{DEV_A};", bind_time=1), pod("next", f"{DEV_B};", bind_time=2)]
    kubelet = {**listed(pods[0], held={"main": HELD}), **listed(pods[1])}
    assert served_name(pods, kubelet) == "next"


def test_two_pods_that_could_be_in_line_are_ambiguous_and_nobody_is_served() -> None:
    pods = [pod("a", f"{DEV_A};", bind_time=1), pod("b", f"{DEV_B};", bind_time=1)]
    choice = choose(pods, node=NODE, device_count=1, kubelet=kubelet_view(pods, node=NODE, also={"b"}))
    assert choice.served is None
    assert choice.refused is None
    assert [p["metadata"]["name"] for p in choice.ambiguous] == ["a", "b"]


def test_a_pod_annotated_but_not_yet_bound_is_not_served() -> None:
    # Mid-bind: the extender wrote the allocation, the Binding is not there yet; even listed, it is
    # not this node's.
    mid_bind = pod("mid-bind", f"{DEV_A};", bind_time=1)
    del mid_bind["spec"]["nodeName"]
    pods = [mid_bind, pod("bound", f"{DEV_B};", bind_time=2)]
    assert served_name(pods, listed(*pods)) == "bound"


def test_device_count_must_match_the_next_container() -> None:
    # Both listed: the count tells which one the kubelet is allocating.
    pods = [pod("two", f"{DEV_A}{DEV_B};", bind_time=1), pod("one", f"{DEV_A};", bind_time=2)]
    kubelet = listed(*pods)
    assert served_name(pods, kubelet, count=1) == "one"
    served = choose(pods, node=NODE, device_count=2, kubelet=kubelet).served
    assert served is not None
    assert served.name == "two"
    assert len(served.devices) == 2


def test_init_container_slot_first_then_app_containers() -> None:
    p = pod("multi", f"{DEV_A};;{DEV_B};", init=("setup",), containers=("idle", "app"))
    first = choose([p], node=NODE, device_count=1, kubelet=listed(p)).served
    assert first is not None
    assert (first.container, first.slot, first.done) == ("setup", 0, False)
    assert decode_pod_devices(first.to_allocate) == [[], [], [ContainerDevice("GPU-B", "NVIDIA", 1000, 0)]]
    p["metadata"]["annotations"][keys.DEVICES_TO_ALLOCATE] = first.to_allocate
    second = choose([p], node=NODE, device_count=1, kubelet=listed(p)).served
    assert second is not None
    assert (second.container, second.slot, second.done, second.priority) == ("app", 2, True, None)


def test_a_native_sidecar_is_served_in_its_slot_between_the_init_containers() -> None:
    # The kubelet admits a pod's containers in spec order, sidecars among the init containers: each
    # Allocate gets the next slot, and the sidecar's GPU stays its own (it is not reused later).
    p = pod("side", f"{DEV_A};{DEV_B};{DEV_A};", init=("setup", "proxy"), containers=("app",))
    p["spec"]["initContainers"][1]["restartPolicy"] = "Always"
    served = []
    for _ in range(3):
        got = choose([p], node=NODE, device_count=1, kubelet=listed(p)).served
        assert got is not None
        served.append((got.container, got.slot, [d.uuid for d in got.devices]))
        p["metadata"]["annotations"][keys.DEVICES_TO_ALLOCATE] = got.to_allocate
    assert served == [("setup", 0, ["GPU-A"]), ("proxy", 1, ["GPU-B"]), ("app", 2, ["GPU-A"])]


def test_a_list_without_the_empty_slot_of_an_init_container_serves_the_gpu_container() -> None:
    # HAMi's scheduler writes init(no GPU) + main(GPU) as one slot: it is main's.
    p = builders.allocating_pod(
        "hami",
        builders.container("main", gpu=1, priority=0),
        init=[builders.container("setup")],
        node=NODE,
        allocated=f"{DEV_A};",
        to_allocate=f"{DEV_A};",
        bind_time=100,
    )
    served = choose([p], node=NODE, device_count=1, kubelet=listed(p)).served
    assert served is not None
    assert (served.container, served.priority, served.done) == ("main", 0, True)


def test_served_finished_other_node_and_deleting_pods_are_skipped() -> None:
    deleting = pod("deleting", f"{DEV_A};")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    rejected = pod("rejected", f"{DEV_A};")
    rejected["status"] = {"phase": "Failed"}
    pods = [
        pod("done", ";", phase="success"),
        pod("elsewhere", f"{DEV_A};", node="other"),
        deleting,
        rejected,
        pod("served", ";"),
    ]
    assert pending_pods(pods, NODE) == [pods[4]]
    assert choose(pods, node=NODE, device_count=1, kubelet=listed(*pods)).served is None


def test_malformed_annotation_is_reported_not_guessed() -> None:
    pods = [pod("bad", "GPU-A,NVIDIA,lots,0:;", bind_time=1), pod("good", f"{DEV_A};", bind_time=2)]
    choice = choose(pods, node=NODE, device_count=1, kubelet=listed(*pods))
    assert choice.served is not None
    assert choice.served.name == "good"
    assert [p["metadata"]["name"] for p, _ in choice.broken] == ["bad"]
    assert "lots" in choice.broken[0][1]


def test_missing_annotation_and_slot_past_the_containers_are_broken() -> None:
    pods = [pod("missing", None), pod("short", f";;{DEV_A};", containers=("only",))]
    choice = choose(pods, node=NODE, device_count=1, kubelet=listed(*pods))
    assert choice.served is None
    reasons = {p["metadata"]["name"]: why for p, why in choice.broken}
    assert "missing" in reasons["missing"]
    assert "3 slots (1 with devices) for 1 containers" in reasons["short"]


def test_a_slot_just_past_the_last_container_is_broken() -> None:
    p = pod("short", f";{DEV_A};", containers=("only",))
    choice = choose([p], node=NODE, device_count=1, kubelet=listed(p))
    assert choice.served is None
    assert [why for _, why in choice.broken] == [
        f"{keys.DEVICES_TO_ALLOCATE}: 2 slots (1 with devices) for 1 containers, 0 of them asking for GPUs"
        f" (got ';{DEV_A};')"
    ]


@pytest.mark.parametrize("phase", ["success", "failed", None], ids=["success", "failed", "no-phase"])
def test_only_pods_in_bind_phase_allocating_are_served(phase: str | None) -> None:
    # success: every container served; failed: the plugin gave up on it; none: not bound by us.
    p = pod("p", f"{DEV_A};")
    if phase is None:
        del p["metadata"]["annotations"][keys.BIND_PHASE]
    else:
        p["metadata"]["annotations"][keys.BIND_PHASE] = phase
    assert pending_pods([p], NODE) == []
    assert choose([p], node=NODE, device_count=1, kubelet=listed(p)) == Choice(served=None, broken=[])


def test_waiting_pods_are_considered_by_namespace_and_name() -> None:
    pods = [pod("b", f"{DEV_A};", bind_time=6), pod("a", f"{DEV_B};", bind_time=7)]
    assert [p["metadata"]["name"] for p in pending_pods(pods, NODE)] == ["a", "b"]


def test_a_waiting_pod_with_nothing_left_to_serve_does_not_stop_the_line() -> None:
    # Every slot empty while still "allocating" (its success patch never landed): nothing to serve
    # there, and the pod the kubelet admits after it is served.
    pods = [pod("drained", ";", bind_time=1), pod("next", f"{DEV_B};", bind_time=2)]
    assert served_name(pods, kubelet_view(pods, node=NODE)) == "next"
