"""Which pod and container an Allocate is for (allocating.choose)."""

from __future__ import annotations

from typing import Any

import builders
import pytest

from hamipy.device_plugin.allocating import Choice, choose, pending_pods
from hamipy.protocol import ContainerDevice, ProtocolError, decode_pod_devices, keys

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
    """A pod the extender bound to ``node``: its ``to_allocate`` devices (``None``: no annotation),
    bind phase and time; every container asks for as many GPUs as its slot holds (as the extender
    planned it), and every app container has the env ``X=1``."""
    asks = _asks(to_allocate, len(init) + len(containers))
    return builders.pod(
        name,
        *(builders.container(c, gpu=asks[len(init) + i], env={"X": "1"}) for i, c in enumerate(containers)),
        init=[builders.container(c, gpu=asks[i]) for i, c in enumerate(init)],
        namespace="ns",
        uid=f"uid-{name}",
        annotations=builders.allocation(to_allocate=to_allocate, node=node, phase=phase, bind_time=bind_time),
        node_name=node,
        scheduler_name="hami-scheduler",
    )


def _asks(to_allocate: str | None, containers: int) -> list[int | None]:
    """Per container, the GPUs its slot of ``to_allocate`` holds (None: none, or unreadable)."""
    try:
        slots = decode_pod_devices(to_allocate or "")
    except ProtocolError:
        return [None] * containers
    return [(len(slots[i]) or None) if i < len(slots) else None for i in range(containers)]


def test_oldest_bind_is_served_first() -> None:
    pods = [pod("late", f"{DEV_A};", bind_time=200), pod("early", f"{DEV_B};", bind_time=100)]
    served = choose(pods, node=NODE, device_count=1).served
    assert served is not None
    assert (served.name, served.container, served.slot) == ("early", "main", 0)
    assert served.devices == [ContainerDevice("GPU-B", "NVIDIA", 1000, 0)]
    assert served.done
    assert served.to_allocate == ";"


def test_bind_order_from_the_watch_beats_the_seconds_stamp() -> None:
    # Bound in the same second: only the order the watch saw them bound tells which came first.
    pods = [pod("second", f"{DEV_A};", bind_time=100), pod("first", f"{DEV_B};", bind_time=100)]
    order = {"uid-first": 0, "uid-second": 1}
    served = choose(pods, node=NODE, device_count=1, bind_order=lambda p: order[p["metadata"]["uid"]]).served
    assert served is not None
    assert served.name == "first"


def test_a_pod_annotated_but_not_yet_bound_is_not_served() -> None:
    # Mid-bind: the extender wrote the allocation, the Binding is not there yet; the kubelet cannot
    # be admitting it, whoever holds the node lock.
    mid_bind = pod("mid-bind", f"{DEV_A};", bind_time=1)
    del mid_bind["spec"]["nodeName"]
    pods = [mid_bind, pod("bound", f"{DEV_B};", bind_time=2)]
    served = choose(pods, node=NODE, device_count=1).served
    assert served is not None
    assert served.name == "bound"


def test_device_count_must_match_the_next_container() -> None:
    pods = [pod("two", f"{DEV_A}{DEV_B};", bind_time=1), pod("one", f"{DEV_A};", bind_time=2)]
    served = choose(pods, node=NODE, device_count=1).served
    assert served is not None
    assert served.name == "one"
    served = choose(pods, node=NODE, device_count=2).served
    assert served is not None
    assert served.name == "two"
    assert len(served.devices) == 2


def test_init_container_slot_first_then_app_containers() -> None:
    p = pod("multi", f"{DEV_A};;{DEV_B};", init=("setup",), containers=("idle", "app"))
    first = choose([p], node=NODE, device_count=1).served
    assert first is not None
    assert (first.container, first.slot, first.done) == ("setup", 0, False)
    assert decode_pod_devices(first.to_allocate) == [[], [], [ContainerDevice("GPU-B", "NVIDIA", 1000, 0)]]
    p["metadata"]["annotations"][keys.DEVICES_TO_ALLOCATE] = first.to_allocate
    second = choose([p], node=NODE, device_count=1).served
    assert second is not None
    assert (second.container, second.slot, second.done) == ("app", 2, True)
    assert second.container_env == [{"name": "X", "value": "1"}]


def test_a_native_sidecar_is_served_in_its_slot_between_the_init_containers() -> None:
    # The kubelet admits a pod's containers in spec order, sidecars among the init containers: each
    # Allocate gets the next slot, and the sidecar's GPU stays its own (it is not reused later).
    p = pod("side", f"{DEV_A};{DEV_B};{DEV_A};", init=("setup", "proxy"), containers=("app",))
    p["spec"]["initContainers"][1]["restartPolicy"] = "Always"
    served = []
    for _ in range(3):
        got = choose([p], node=NODE, device_count=1).served
        assert got is not None
        served.append((got.container, got.slot, [d.uuid for d in got.devices]))
        p["metadata"]["annotations"][keys.DEVICES_TO_ALLOCATE] = got.to_allocate
    assert served == [("setup", 0, ["GPU-A"]), ("proxy", 1, ["GPU-B"]), ("app", 2, ["GPU-A"])]


def test_a_list_without_the_empty_slot_of_an_init_container_serves_the_gpu_container() -> None:
    # HAMi's scheduler writes init(no GPU) + main(GPU) as one slot: it is main's, with main's env.
    p = builders.pod(
        "hami",
        builders.container("main", gpu=1, env={"X": "1"}),
        init=[builders.container("setup", env={"CUDA_DISABLE_CONTROL": "true"})],
        namespace="ns",
        uid="uid-hami",
        annotations=builders.allocation(
            allocated=f"{DEV_A};", to_allocate=f"{DEV_A};", node=NODE, phase="allocating", bind_time=100
        ),
        node_name=NODE,
        scheduler_name="hami-scheduler",
    )
    served = choose([p], node=NODE, device_count=1).served
    assert served is not None
    assert (served.container, served.container_env, served.done) == (
        "main",
        [{"name": "X", "value": "1"}],
        True,
    )


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
    assert choose(pods, node=NODE, device_count=1).served is None


def test_malformed_annotation_is_reported_not_guessed() -> None:
    pods = [pod("bad", "GPU-A,NVIDIA,lots,0:;", bind_time=1), pod("good", f"{DEV_A};", bind_time=2)]
    choice = choose(pods, node=NODE, device_count=1)
    assert choice.served is not None
    assert choice.served.name == "good"
    assert [p["metadata"]["name"] for p, _ in choice.broken] == ["bad"]
    assert "lots" in choice.broken[0][1]


def test_missing_annotation_and_slot_past_the_containers_are_broken() -> None:
    pods = [pod("missing", None), pod("short", f";;{DEV_A};", containers=("only",))]
    choice = choose(pods, node=NODE, device_count=1)
    assert choice.served is None
    reasons = {p["metadata"]["name"]: why for p, why in choice.broken}
    assert "missing" in reasons["missing"]
    assert "3 slots (1 with devices) for 1 containers" in reasons["short"]


def test_a_slot_just_past_the_last_container_is_broken() -> None:
    choice = choose([pod("short", f";{DEV_A};", containers=("only",))], node=NODE, device_count=1)
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
    assert choose([p], node=NODE, device_count=1) == Choice(served=None, broken=[])


INT64_MAX = 2**63 - 1
"""The largest bind-time a Go writer (``time.Unix()``, an int64) can stamp."""


@pytest.mark.parametrize(
    "stamp",
    [None, "", "soon", "-5", "1.5", "²"],
    ids=["absent", "empty", "word", "negative", "fraction", "superscript-digit"],
)
@pytest.mark.parametrize("stamped", [1_750_000_000, INT64_MAX], ids=["now", "int64-max"])
def test_a_pod_without_a_readable_bind_time_is_served_after_stamped_ones(
    stamp: str | None, stamped: int
) -> None:
    # "a-..." sorts first by name: only the bind time puts it last.
    unreadable = pod("a-unstamped", f"{DEV_A};")
    del unreadable["metadata"]["annotations"][keys.BIND_TIME]
    if stamp is not None:
        unreadable["metadata"]["annotations"][keys.BIND_TIME] = stamp
    pods = [unreadable, pod("z-stamped", f"{DEV_B};", bind_time=stamped)]
    assert [p["metadata"]["name"] for p in pending_pods(pods, NODE)] == ["z-stamped", "a-unstamped"]
    served = choose(pods, node=NODE, device_count=1).served
    assert served is not None
    assert served.name == "z-stamped"


def test_pods_bound_in_the_same_second_are_served_by_name() -> None:
    pods = [pod("b", f"{DEV_A};", bind_time=7), pod("a", f"{DEV_B};", bind_time=7)]
    assert [p["metadata"]["name"] for p in pending_pods(pods, NODE)] == ["a", "b"]


def test_a_waiting_pod_with_nothing_left_to_serve_does_not_stop_the_line() -> None:
    # Every slot empty while still "allocating" (its success patch never landed): nothing to serve
    # there, and the pods behind it are still considered.
    pods = [pod("drained", ";", bind_time=1), pod("next", f"{DEV_B};", bind_time=2)]
    served = choose(pods, node=NODE, device_count=1).served
    assert served is not None
    assert served.name == "next"
