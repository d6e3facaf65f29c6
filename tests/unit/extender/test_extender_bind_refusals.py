"""``/bind`` binds only pods the hami-scheduler profile hands to this extender: the pod of
the bind's UID, asking for our scheduler and naming a GPU resource of ours. Anything else is refused
with a reason in the ExtenderBindingResult and a log line naming the pod, and nothing is written."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from builders import container, gpu_pod
from extender_fakes import BindRig, bind_args, bind_rig, filter_args

from hamipy.extender.extender_args import ExtenderBindingArgs
from hamipy.extender.model import PodUid
from hamipy.protocol.config import Config, NvidiaConfig

POD_PATH = "/api/v1/namespaces/tenant/pods/victim"


def victim(*containers: dict[str, Any], scheduler_name: str = "hami-scheduler") -> dict[str, Any]:
    return gpu_pod("victim", *containers, namespace="tenant", scheduler_name=scheduler_name)


def writes(r: BindRig) -> list[tuple[str, str]]:
    """Every write the bind made: pod patches, Bindings, node (lock) patches."""
    return [call for call in r.kube.calls if call[0] != "GET"]


def warnings(r: BindRig) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in r.log.getvalue().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == "bind failed"]


async def refused(r: BindRig, args: ExtenderBindingArgs) -> str:
    error: str = (await r.scheduler.bind(args))["Error"]
    assert error, "the bind must be refused"
    assert writes(r) == []
    assert "nodeName" not in r.kube.pod("tenant", "victim")["spec"]
    [line] = warnings(r)
    assert (line["namespace"], line["pod"], line["error"]) == ("tenant", "victim", error)
    return error


async def test_a_pod_asking_no_gpu_resource_is_refused() -> None:
    r = bind_rig()
    p = victim(container())
    r.kube.add(p)
    error = await refused(r, bind_args(p))
    assert error == "pod tenant/victim asks for no GPU resource this extender manages"


@pytest.mark.parametrize("scheduler_name", ["default-scheduler", "other-scheduler"])
async def test_a_pod_for_another_scheduler_is_refused(scheduler_name: str) -> None:
    r = bind_rig()
    p = victim(container(gpu=1, gpumem=1000), scheduler_name=scheduler_name)
    r.kube.add(p)
    error = await refused(r, bind_args(p))
    assert error == f"pod tenant/victim is not for hami-scheduler (schedulerName {scheduler_name})"


async def test_a_bind_whose_uid_is_not_the_pods_is_refused() -> None:
    r = bind_rig()
    p = victim()
    r.kube.add(p)
    error = await refused(r, msgspec.structs.replace(bind_args(p), pod_uid=PodUid("uid-of-an-earlier-pod")))
    assert error == "pod tenant/victim was replaced (uid uid-tenant-victim, not uid-of-an-earlier-pod)"


async def test_a_bind_without_a_pod_uid_is_refused() -> None:
    r = bind_rig()
    p = victim()
    r.kube.add(p)
    error = await refused(r, msgspec.structs.replace(bind_args(p), pod_uid=PodUid("")))
    assert error == "pod tenant/victim cannot be bound without its PodUID"


async def test_the_configured_scheduler_and_resource_names_are_the_ones_accepted() -> None:
    config = Config(scheduler_name="gpu-sched", nvidia=NvidiaConfig(resource_count_name="example.com/vgpu"))
    r = bind_rig(config=config)
    ours = gpu_pod("ours", container(limits={"example.com/vgpu": "1"}), scheduler_name="gpu-sched")
    r.kube.add(ours)
    assert (await r.scheduler.bind(bind_args(ours)))["Error"] == ""
    assert r.kube.pod("ns", "ours")["spec"]["nodeName"] == "n"
    # nvidia.com/gpu is not a resource of this configuration, and hami-scheduler not its scheduler.
    p = victim(container(gpu=1), scheduler_name="gpu-sched")
    r.kube.add(p)
    calls = len(r.kube.calls)
    assert "asks for no GPU resource" in (await r.scheduler.bind(bind_args(p)))["Error"]
    q = gpu_pod("q", container(limits={"example.com/vgpu": "1"}))
    r.kube.add(q)
    assert (
        "is not for gpu-sched (schedulerName hami-scheduler)"
        in (await r.scheduler.bind(bind_args(q)))["Error"]
    )
    assert [c for c in r.kube.calls[calls:] if c[0] != "GET"] == []


async def test_a_refused_bind_releases_the_pods_reservation() -> None:
    r = bind_rig()
    p = victim(container(gpu=1, gpumem=1000), scheduler_name="default-scheduler")
    r.add_watched_pod(victim(container(gpu=1, gpumem=1000)))  # reserved while it was ours
    r.scheduler.filter(filter_args(p, ["n"]))
    assert "uid-tenant-victim" in r.model.contributions
    r.kube.pod("tenant", "victim")["spec"]["schedulerName"] = "default-scheduler"
    r.model.apply_pod("MODIFIED", r.kube.pod("tenant", "victim"))  # as the watch delivers it
    await refused(r, bind_args(p))
    assert r.model.contributions == {}


async def test_a_made_up_bind_frees_no_other_pods_reservation() -> None:
    r = bind_rig()
    reserved = gpu_pod("reserved")
    r.add_watched_pod(reserved)
    r.scheduler.filter(filter_args(reserved, ["n"]))
    r.kube.add(victim())
    for args in (
        msgspec.structs.replace(bind_args(victim()), pod_uid=PodUid("uid-ns-reserved")),  # another pod's UID
        msgspec.structs.replace(bind_args(reserved), pod_name="nobody"),  # a pod that does not exist
    ):
        assert (await r.scheduler.bind(args))["Error"]
    assert r.model.contributions[PodUid("uid-ns-reserved")].source == "reserved"
