"""MIG in the extender: dynamic MIG GPUs get a profile and placement per device, counted in the
model from pods' ``hami.io/vgpu-mig-allocations`` and from decisions in flight; pre-made MIG
instances are exclusive devices; ``nvidia.com/vgpu-mode`` keeps MIG and shared pods apart."""

from __future__ import annotations

from typing import Any

import pytest
from builders import A100_MIG_PROFILES, container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_rig, filter_args

from hamipy.extender.filtering import build_ask
from hamipy.extender.fitting import fit_pod
from hamipy.extender.invariant import check_cluster
from hamipy.extender.mig_placement import overlaps
from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.preemption import plan_node, preemptor_of
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import ContainerDevice, DeviceInfo, MigPlacement, MigProfile
from hamipy.protocol.mig_allocations import MigAllocation, decode_mig_allocations, encode_mig_allocations
from hamipy.protocol.pod_devices import decode_pod_devices, encode_pod_devices

CONFIG = Config()
MIG = {keys.VGPU_MODE: "mig"}


def _p(start: int, size: int) -> MigPlacement:
    return MigPlacement(start, size)


PROFILES = A100_MIG_PROFILES


def mig_gpu(uuid: str = "M", index: int = 0) -> DeviceInfo:
    """An A100 40GB in dynamic MIG mode, as our device plugin registers it."""
    return DeviceInfo(uuid, index, 7, 40960, 100, "NVIDIA-A100-SXM4-40GB", 0, "mig", True, PROFILES)


def instance(uuid: str, index: int = 0, mem: int = 9984) -> DeviceInfo:
    """A pre-made MIG instance, registered as a device of its own."""
    return DeviceInfo(uuid, index, 1, mem, 29, "NVIDIA-A100-SXM4-40GB", 0, "mig", True)


def mig_pod(name: str, mem: int, *, annotations: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    return gpu_pod(name, container(gpu=1, gpumem=mem), annotations={**MIG, **(annotations or {})}, **kw)


def bound_mig_pod(name: str, node: str, gpu_uuid: str, profile: MigProfile, start: int) -> dict[str, Any]:
    """A pod bound to ``node`` holding one ``profile`` instance at ``start`` (as after a bind of ours)."""
    placement = next(p for p in profile.placements if p.start == start)
    devices = [[ContainerDevice(gpu_uuid, "NVIDIA", profile.memory_mb, profile.core)]]
    mig = encode_mig_allocations([MigAllocation(0, 0, gpu_uuid, profile.name, placement)])
    annotations = {keys.DEVICES_ALLOCATED: encode_pod_devices(devices), keys.MIG_ALLOCATIONS: mig}
    return mig_pod(name, profile.memory_mb, annotations=annotations, node_name=node, phase="Running")


def model_with(*nodes: dict[str, Any], pods: tuple[dict[str, Any], ...] = ()) -> ClusterModel:
    model = ClusterModel()
    model.replace_nodes(nodes)
    model.replace_pods(pods)
    return model


def fit(model: ClusterModel, p: dict[str, Any], node: str = "n") -> Any:
    return fit_pod(model.nodes[NodeName(node)], build_ask(p, CONFIG))


NAMED = {p.name: p for p in PROFILES}


def reserve(model: ClusterModel, devices: Any) -> None:
    """A filter's reservation of ``devices`` on ``n`` for pod ``p``."""
    model.reserve(
        uid=PodUid("u-p"),
        namespace="ns",
        name="p",
        node=NodeName("n"),
        devices=devices,
        n_init=0,
        expires_at=9e9,
    )


# -- the fit -----------------------------------------------------------------------------------------


def test_a_device_gets_the_smallest_covering_profile_and_its_memory_and_sms() -> None:
    model = model_with(gpu_node("n", [mig_gpu()]))
    result = fit(model, mig_pod("p", 8000))
    assert result.devices == [[ContainerDevice("M", "NVIDIA", 10240, 28)]]


def test_a_percentage_ask_is_of_the_gpus_memory() -> None:
    model = model_with(gpu_node("n", [mig_gpu()]))
    p = gpu_pod("p", container(gpu=1, gpumem_percentage=25), annotations=MIG)
    assert fit(model, p).devices == [[ContainerDevice("M", "NVIDIA", 10240, 28)]]


def test_an_ask_larger_than_every_profile_is_short_of_memory() -> None:
    """The whole GPU (no memory asked) is more than its 7g instance has: ask for memory instead."""
    model = model_with(gpu_node("n", [mig_gpu()]))
    assert fit(model, gpu_pod("p", container(gpu=1), annotations=MIG)).why().text() == (
        "1/1 CardInsufficientMemory"
    )


def test_a_fragmented_gpu_is_reported_as_such() -> None:
    """Two 2g and a 1g leave 15 GiB, but no 2g or 3g placement clear of them."""
    pods = (
        bound_mig_pod("a", "n", "M", NAMED["2g.10gb"], 0),
        bound_mig_pod("b", "n", "M", NAMED["2g.10gb"], 2),
        bound_mig_pod("c", "n", "M", NAMED["1g.5gb"], 5),
    )
    model = model_with(gpu_node("n", [mig_gpu()]), pods=pods)
    result = fit(model, mig_pod("p", 10000))
    assert not result.ok
    assert result.why().text() == "1/1 CardMigTopologyInfeasible"
    # A 1g still fits, at the free slot left highest.
    assert fit(model, mig_pod("q", 5000)).devices == [[ContainerDevice("M", "NVIDIA", 5120, 14)]]
    assert model.mig_plan(NodeName("n"), fit(model, mig_pod("q", 5000)).devices) == (
        MigAllocation(0, 0, "M", "1g.5gb", _p(6, 1)),
    )


def test_a_gpu_without_the_memory_is_short_of_memory_not_fragmented() -> None:
    model = model_with(gpu_node("n", [mig_gpu()]), pods=(bound_mig_pod("a", "n", "M", NAMED["7g.40gb"], 0),))
    assert fit(model, mig_pod("p", 5000)).why().text() == "1/1 CardInsufficientMemory"


def test_one_containers_devices_go_to_distinct_gpus_each_with_its_instance() -> None:
    model = model_with(gpu_node("n", [mig_gpu("M0", 0), mig_gpu("M1", 1)]))
    p = gpu_pod("p", container(gpu=2, gpumem=20000), annotations=MIG)
    devices = fit(model, p).devices
    assert sorted(d.uuid for d in devices[0]) == ["M0", "M1"]
    plan = model.mig_plan(NodeName("n"), devices)
    assert plan is not None
    assert {(a.gpu_uuid, a.profile, a.placement) for a in plan} == {
        ("M0", "3g.20gb", _p(4, 4)),
        ("M1", "3g.20gb", _p(4, 4)),
    }


def test_the_instances_of_all_containers_of_a_pod_are_kept_apart() -> None:
    model = model_with(gpu_node("n", [mig_gpu()]))
    p = gpu_pod(
        "p",
        container("a", gpu=1, gpumem=20000),
        container("b", gpu=1, gpumem=10000),
        init=[container("i", gpu=1, gpumem=5000)],
        annotations=MIG,
    )
    devices = fit(model, p).devices
    plan = model.mig_plan(NodeName("n"), devices)
    assert plan is not None
    assert [(a.container_index, a.profile, a.placement) for a in plan] == [
        (0, "1g.5gb", _p(6, 1)),
        (1, "3g.20gb", _p(0, 4)),  # 4..8 overlaps the init container's slice 6
        (2, "2g.10gb", _p(4, 2)),  # 0 and 2 are in the 3g
    ]
    assert devices[2] == [ContainerDevice("M", "NVIDIA", 10240, 28)]


# -- vgpu-mode -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("mig", "M"), ("hami-core", "S"), (None, "S")],
    ids=["mig-pod", "shared-pod", "unasked-is-shared"],
)
def test_vgpu_mode_keeps_mig_and_shared_pods_apart(mode: str | None, expected: str) -> None:
    model = model_with(gpu_node("n", [mig_gpu("M", 0), gpu("S", 1)]))
    annotations = {keys.VGPU_MODE: mode} if mode else {}
    for _ in range(3):
        devices = fit(model, gpu_pod("p", container(gpu=1, gpumem=1000), annotations=annotations)).devices
        assert devices is not None
        assert devices[0][0].uuid == expected


def test_a_mig_pod_on_shared_gpus_only_is_a_type_mismatch_and_back() -> None:
    shared = model_with(gpu_node("n", [gpu("S", 0)]))
    assert fit(shared, mig_pod("p", 1000)).why().text() == "1/1 CardTypeMismatch"
    mig = model_with(gpu_node("n", [mig_gpu()]))
    hami = gpu_pod("p", container(gpu=1, gpumem=1000), annotations={keys.VGPU_MODE: "hami-core"})
    assert fit(mig, hami).why().text() == "1/1 CardTypeMismatch"
    assert fit(mig, gpu_pod("q", container(gpu=1, gpumem=1000))).why().text() == "1/1 CardTypeMismatch"


# -- pre-made instances ---------------------------------------------------------------------------


def test_a_premade_instance_is_one_containers_alone() -> None:
    model = model_with(gpu_node("n", [instance("MIG-a")]))
    devices = fit(model, mig_pod("p", 4000)).devices
    assert devices == [[ContainerDevice("MIG-a", "NVIDIA", 4000, 0)]]
    reserve(model, devices)
    assert fit(model, mig_pod("q", 1000)).why().text() == "1/1 CardTimeSlicingExhausted"
    assert fit(model_with(gpu_node("n", [instance("MIG-a")])), mig_pod("r", 10000)).why().text() == (
        "1/1 CardInsufficientMemory"
    )


# -- the model ------------------------------------------------------------------------------------


def test_occupied_placements_come_back_from_the_annotations_after_a_restart() -> None:
    pods = (
        bound_mig_pod("a", "n", "M", NAMED["3g.20gb"], 4),
        bound_mig_pod("b", "n", "M", NAMED["2g.10gb"], 0),
    )
    model = model_with(gpu_node("n", [mig_gpu()]), pods=pods)
    assert sorted(model.nodes[NodeName("n")].gpus[0].mig_taken, key=lambda p: p.start) == [_p(0, 2), _p(4, 4)]
    devices = fit(model, mig_pod("p", 10000)).devices
    assert model.mig_plan(NodeName("n"), devices) == (MigAllocation(0, 0, "M", "2g.10gb", _p(2, 2)),)
    # The 3g's pod goes: its slices are free again.
    model.apply_pod("DELETED", pods[0])
    assert model.nodes[NodeName("n")].gpus[0].mig_taken == [_p(0, 2)]


def test_a_node_registering_again_keeps_its_pods_instances() -> None:
    model = model_with(gpu_node("n", [mig_gpu()]), pods=(bound_mig_pod("a", "n", "M", NAMED["3g.20gb"], 4),))
    again = gpu_node("n", [mig_gpu()])
    again["metadata"]["annotations"][keys.DEVICE_CORDON] = "other"  # a change that rebuilds the GPUs
    model.apply_node("MODIFIED", again)
    assert model.nodes[NodeName("n")].gpus[0].mig_taken == [_p(4, 4)]


def test_a_reservation_holds_its_placement_until_released() -> None:
    model = model_with(gpu_node("n", [mig_gpu()]))
    devices = fit(model, mig_pod("p", 20000)).devices
    reserve(model, devices)
    assert model.contributions[PodUid("u-p")].mig == (MigAllocation(0, 0, "M", "3g.20gb", _p(4, 4)),)
    other = fit(model, mig_pod("q", 20000)).devices
    assert model.mig_plan(NodeName("n"), other) == (MigAllocation(0, 0, "M", "3g.20gb", _p(0, 4)),)
    # Reserving the same pod again plans beside what others hold, not beside itself.
    reserve(model, devices)
    assert model.contributions[PodUid("u-p")].mig[0].placement == _p(4, 4)
    model.release(PodUid("u-p"))
    assert model.nodes[NodeName("n")].gpus[0].mig_taken == []


def test_a_malformed_mig_allocation_on_a_bound_pod_blocks_its_node() -> None:
    bad = bound_mig_pod("a", "n", "M", NAMED["1g.5gb"], 6)
    bad["metadata"]["annotations"][keys.MIG_ALLOCATIONS] = '[{"containerIndex":0}]'
    model = model_with(gpu_node("n", [mig_gpu()]))
    (problem,) = model.apply_pod("ADDED", bad)
    assert problem.annotation == keys.MIG_ALLOCATIONS
    assert problem.field == keys.MIG_ALLOCATIONS + "[0].deviceIndex"
    assert not model.nodes[NodeName("n")].usable(0.0)
    model.apply_pod("DELETED", bad)
    assert model.nodes[NodeName("n")].usable(0.0)


def test_the_device_plugins_runtime_fields_change_nothing_held() -> None:
    p = bound_mig_pod("a", "n", "M", NAMED["1g.5gb"], 6)
    model = model_with(gpu_node("n", [mig_gpu()]), pods=(p,))
    (made,) = decode_mig_allocations(p["metadata"]["annotations"][keys.MIG_ALLOCATIONS])
    p["metadata"]["annotations"][keys.MIG_ALLOCATIONS] = encode_mig_allocations(
        [MigAllocation(0, 0, "M", "1g.5gb", _p(6, 1), "MIG-x", 13, 0)]
    )
    model.apply_pod("MODIFIED", p)
    assert model.nodes[NodeName("n")].gpus[0].mig_taken == [made.placement]


# -- preemption -----------------------------------------------------------------------------------


def test_preemption_frees_the_placements_of_the_pods_it_evicts() -> None:
    """Three low-priority 2g.10gb instances (slices 0-1, 2-3, 4-5) leave neither the memory nor a
    placement for a 3g.20gb: evicting the one on 4-5 frees both (3g fills from the top), so it
    alone is the victim, and the preemptor's plan is that placement."""
    low = [
        bound_mig_pod(name, "n", "M", NAMED["2g.10gb"], start)
        for name, start in (("a", 0), ("b", 2), ("c", 4))
    ]
    model = model_with(gpu_node("n", [mig_gpu()], ours=True), pods=tuple(low))
    urgent = mig_pod("urgent", 16000)
    urgent["spec"]["priority"] = 1000
    assert fit(model, urgent).why().text() == "1/1 CardInsufficientMemory"
    preemptor = preemptor_of(PodUid(urgent["metadata"]["uid"]), urgent, build_ask(urgent, CONFIG))
    assert preemptor is not None
    plan = plan_node(model, model.nodes[NodeName("n")], preemptor)
    assert plan is not None
    assert [v.name for v in plan.victims] == ["c"]
    assert model.mig_plan(NodeName("n"), plan.devices) is None  # not before the victim is gone
    ((device,),) = plan.devices
    assert (device.uuid, device.usedmem) == ("M", NAMED["3g.20gb"].memory_mb)


# -- bind -----------------------------------------------------------------------------------------


def rig() -> BindRig:
    return bind_rig(BIND_SETTINGS, gpu_node("n", [mig_gpu()], ours=True))


async def _schedule(r: BindRig, p: dict[str, Any]) -> dict[str, str]:
    r.add_watched_pod(p)
    answer = r.scheduler.filter(filter_args(p, ["n"]))
    assert answer["NodeNames"] == ["n"], answer
    meta = p["metadata"]
    await r.binder.bind(
        namespace=meta["namespace"], name=meta["name"], uid=PodUid(meta["uid"]), node=NodeName("n")
    )
    annotations: dict[str, str] = r.kube.pod(meta["namespace"], meta["name"])["metadata"]["annotations"]
    return annotations


async def test_two_mig_pods_on_one_gpu_get_placements_apart_written_as_hami_reads_them() -> None:
    r = rig()
    first = await _schedule(r, mig_pod("p", 5000))
    second = await _schedule(r, mig_pod("q", 10000))
    assert first[keys.MIG_ALLOCATIONS] == (
        '[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"M","profile":"1g.5gb","placement":{"start":6,"size":1}}]'
    )
    (a,) = decode_mig_allocations(first[keys.MIG_ALLOCATIONS])
    (b,) = decode_mig_allocations(second[keys.MIG_ALLOCATIONS])
    assert not overlaps(a.placement, b.placement)
    assert (await check_cluster(r.kube)).ok
    # The device lists carry the parent GPU with the profile's memory and SMs.
    assert decode_pod_devices(second[keys.DEVICES_ALLOCATED]) == [[ContainerDevice("M", "NVIDIA", 10240, 28)]]
    assert r.model.contributions[PodUid("uid-ns-q")].mig == (b,)
    # 25 GiB are left, but each 3g placement meets one of theirs.
    assert (
        r.scheduler.filter(filter_args(mig_pod("z", 20000), ["n"]))["FailedNodes"]["n"]
        == "1/1 CardMigTopologyInfeasible"
    )


async def test_a_shared_gpus_bind_writes_no_mig_allocations() -> None:
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("S", 0)], ours=True))
    annotations = await _schedule(r, gpu_pod("p"))
    assert keys.MIG_ALLOCATIONS not in annotations


async def test_the_locked_path_plans_on_the_fresh_state() -> None:
    """A node HAMi's plugin reported last: the bind reads the node's pods, whose instances count."""
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [mig_gpu()]))
    r.kube.add(bound_mig_pod("other", "n", "M", NAMED["3g.20gb"], 4))  # the watch has not seen it
    annotations = await _schedule(r, mig_pod("p", 20000))
    (a,) = decode_mig_allocations(annotations[keys.MIG_ALLOCATIONS])
    assert a.placement == _p(0, 4)
