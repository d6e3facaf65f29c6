"""Namespace GPU quotas: ResourceQuota ``limits.nvidia.com/gpumem`` and
``limits.nvidia.com/gpucores`` read as HAMi reads them, charged per GPU (memory x GPUs, percentages
resolved against the GPU chosen), enforced by filter and bind with the quota, used and limit named,
and exported as ``hami_resource_quota_used`` / ``hami_resource_quota_limit``."""

from __future__ import annotations

from typing import Any

import pytest
from builders import container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_rig, filter_args

from hamipy.extender.errors import BindRefused
from hamipy.extender.model import ClusterModel, PodUid
from hamipy.extender.quota import QUOTA_EXCEEDED, Quotas
from hamipy.protocol import keys
from hamipy.protocol.identifiers import NodeName


def quota(name: str, namespace: str = "ns", **hard: str) -> dict[str, Any]:
    """A ResourceQuota with ``hard`` keys given as mem=..., cores=..., cpu=... ."""
    keymap = {"mem": "limits.nvidia.com/gpumem", "cores": "limits.nvidia.com/gpucores", "cpu": "limits.cpu"}
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-q-{name}"},
        "spec": {"hard": {keymap[k]: v for k, v in hard.items()}},
    }


def rig(*quotas: dict[str, Any], mem: int = 32768, gpus: int = 2) -> BindRig:
    """Node ``n`` our device plugin serves (binds decide from the model), ``quotas`` listed."""
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu(f"G{i}", i, mem=mem) for i in range(gpus)], ours=True))
    r.model.quotas.replace(quotas)
    return r


def filter_(r: BindRig, p: dict[str, Any]) -> dict[str, Any]:
    r.add_watched_pod(p)
    return r.scheduler.filter(filter_args(p, ["n"]))


# ---- reading quotas


def test_only_the_gpu_limits_are_read_and_a_deleted_quota_is_forgotten() -> None:
    quotas = Quotas()
    assert quotas.apply("ADDED", quota("q", mem="16384", cores="50", cpu="4")) == []
    assert [(q.key, q.limit) for q in quotas.limits("ns")] == [
        ("limits.nvidia.com/gpumem", 16384),
        ("limits.nvidia.com/gpucores", 50),
    ]
    quotas.apply("DELETED", quota("q", mem="16384"))
    assert quotas.limits("ns") == ()


def test_a_malformed_limit_is_reported_and_not_read_as_zero() -> None:
    quotas = Quotas()
    problems = quotas.apply("ADDED", quota("q", mem="lots", cores="30"))
    assert [(p.namespace, p.name) for p in problems] == [("ns", "q")]
    assert "limits.nvidia.com/gpumem" in problems[0].reason
    assert [(q.key, q.limit) for q in quotas.limits("ns")] == [("limits.nvidia.com/gpucores", 30)]


def test_every_quota_of_a_namespace_holds_and_zero_is_a_limit() -> None:
    quotas = Quotas()
    quotas.replace([quota("wide", mem="65536"), quota("narrow", mem="8192"), quota("none", cores="0")])
    assert quotas.refusal("ns", used=(0, 0), asked=(8192, 0)) is None  # exactly at the limit fits
    why = quotas.refusal("ns", used=(4096, 0), asked=(8192, 0))
    assert why == "quota ns/narrow: limits.nvidia.com/gpumem is 8192, 4096 used, the pod asks 8192"
    assert quotas.refusal("ns", used=(0, 0), asked=(0, 1)) is not None
    assert quotas.refusal("other", used=(10**9, 100), asked=(10**9, 100)) is None


def test_custom_resource_names_give_their_own_keys() -> None:
    from hamipy.protocol.resources import ResourceNames

    quotas = Quotas(ResourceNames(memory="example.com/vmem", cores="example.com/vcores"))
    quotas.apply(
        "ADDED",
        {"metadata": {"name": "q", "namespace": "ns"}, "spec": {"hard": {"limits.example.com/vmem": "100"}}},
    )
    assert [(q.key, q.limit) for q in quotas.limits("ns")] == [("limits.example.com/vmem", 100)]


# ---- charging


def test_a_two_gpu_pod_is_charged_twice_and_reservations_count() -> None:
    r = rig(quota("q", mem="65536"))
    answer = filter_(r, gpu_pod("two", container(gpu=2, gpumem=4096, gpucores=10)))
    assert answer["NodeNames"] == ["n"]
    assert r.model.namespace_usage["ns"] == [8192, 20]  # reserved, not yet bound
    assert r.model.used_by("ns", exclude=PodUid("uid-ns-two")) == (0, 0)
    r.model.release(PodUid("uid-ns-two"))
    assert "ns" not in r.model.namespace_usage


def test_a_percentage_is_charged_as_resolved_on_the_gpu_chosen() -> None:
    r = rig(quota("q", mem="65536"), mem=40000)
    filter_(r, gpu_pod("half", container(gpu=1, gpumem_percentage=50)))
    assert r.model.namespace_usage["ns"][0] == 20000


# ---- filter and bind


def test_the_third_pod_over_the_quota_fails_every_node_naming_the_quota() -> None:
    r = rig(quota("team", mem="16384"))
    for name in ("a", "b"):
        assert filter_(r, gpu_pod(name, container(gpu=1, gpumem=8192)))["NodeNames"] == ["n"]
    answer = filter_(r, gpu_pod("c", container(gpu=1, gpumem=8192)))
    assert answer["NodeNames"] == []
    reason = answer["FailedNodes"]["n"]
    assert reason == (
        f"{QUOTA_EXCEEDED}: quota ns/team: limits.nvidia.com/gpumem is 16384, 16384 used, the pod asks 8192"
    )
    # Another namespace is not charged for ns's pods.
    assert filter_(r, gpu_pod("d", container(gpu=1, gpumem=8192), namespace="other"))["NodeNames"] == ["n"]


def test_a_freed_quota_admits_the_waiting_pod() -> None:
    r = rig(quota("team", mem="16384"))
    filter_(r, gpu_pod("a", container(gpu=1, gpumem=8192)))
    filter_(r, gpu_pod("b", container(gpu=1, gpumem=8192)))
    assert filter_(r, gpu_pod("c", container(gpu=1, gpumem=8192)))["NodeNames"] == []
    r.model.release(PodUid("uid-ns-a"))
    assert r.scheduler.filter(filter_args(gpu_pod("c", container(gpu=1, gpumem=8192)), ["n"]))[
        "NodeNames"
    ] == ["n"]


def test_a_percentage_pod_goes_where_its_charge_fits() -> None:
    """Charges differ per node when memory is a percentage: a refusal on the big GPU's node does
    not end the search, the small GPU's node takes it."""
    r = bind_rig(
        BIND_SETTINGS,
        gpu_node("big", [gpu("B", 0, mem=80000)], ours=True),
        gpu_node("small", [gpu("S", 0, mem=16000)], ours=True),
    )
    r.model.quotas.replace([quota("q", mem="10000")])
    p = gpu_pod("p", container(gpu=1, gpumem_percentage=50))
    r.add_watched_pod(p)
    answer = r.scheduler.filter(filter_args(p, ["big", "small"]))
    assert answer["NodeNames"] == ["small"]


def test_cores_are_limited_too() -> None:
    r = rig(quota("q", cores="30"))
    assert filter_(r, gpu_pod("a", container(gpu=1, gpumem=8192, gpucores=20)))["NodeNames"] == ["n"]
    answer = filter_(r, gpu_pod("b", container(gpu=1, gpumem=8192, gpucores=20)))
    assert "limits.nvidia.com/gpucores is 30, 20 used, the pod asks 20" in answer["FailedNodes"]["n"]


async def test_a_bind_past_the_quota_is_refused() -> None:
    """A filter that passed before the quota was lowered: the bind re-checks against every pod of
    the namespace (in flight ones included) and writes nothing."""
    r = rig()
    filter_(r, gpu_pod("a", container(gpu=1, gpumem=8192)))
    await r.binder.bind(namespace="ns", name="a", uid=PodUid("uid-ns-a"), node=NodeName("n"))
    filter_(r, gpu_pod("b", container(gpu=1, gpumem=8192)))
    r.model.quotas.replace([quota("team", mem="12288")])
    with pytest.raises(
        BindRefused, match=f"{QUOTA_EXCEEDED}: quota ns/team: .* 8192 used, the pod asks 8192"
    ):
        await r.binder.bind(namespace="ns", name="b", uid=PodUid("uid-ns-b"), node=NodeName("n"))
    assert not r.kube.pod("ns", "b")["spec"].get("nodeName")
    assert PodUid("uid-ns-b") not in r.model.contributions
    assert keys.DEVICES_ALLOCATED not in r.kube.pod("ns", "b")["metadata"]["annotations"]


async def test_a_leader_still_catching_up_binds_no_pod_of_a_namespace_with_a_quota() -> None:
    """A quota spans nodes: the locked path's fresh node state cannot show what the namespace holds
    elsewhere, so until the model counts every bound pod such binds are refused (and retried)."""
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("G0", 0, mem=32768)], ours=True), exclusive=False)
    r.model.quotas.replace([quota("team", mem="65536")])
    filter_(r, gpu_pod("a", container(gpu=1, gpumem=8192)))
    waits = f"{QUOTA_EXCEEDED}: namespace ns has a GPU quota .* pods \\(a new leader\\)"
    with pytest.raises(BindRefused, match=waits):
        await r.binder.bind(namespace="ns", name="a", uid=PodUid("uid-ns-a"), node=NodeName("n"))
    assert not r.kube.pod("ns", "a")["spec"].get("nodeName")
    # A namespace without a quota binds on the locked path as before.
    r.model.quotas.replace([])
    await r.binder.bind(namespace="ns", name="a", uid=PodUid("uid-ns-a"), node=NodeName("n"))
    assert r.kube.pod("ns", "a")["spec"]["nodeName"] == "n"


# ---- metrics


def test_quota_gauges_have_hamis_names_and_labels() -> None:
    r = rig(quota("wide", mem="65536"), quota("narrow", mem="16384", cores="50"))
    r.telemetry.metrics.attach(r.model)
    filter_(r, gpu_pod("a", container(gpu=2, gpumem=4096, gpucores=10)))
    sample = r.telemetry.metrics.registry.get_sample_value
    assert (
        sample(
            "hami_resource_quota_used",
            {"namespace": "ns", "quota_name": "nvidia.com/gpumem", "limit": "16384"},
        )
        == 8192
    )
    assert (
        sample("hami_resource_quota_limit", {"namespace": "ns", "quota_name": "nvidia.com/gpumem"}) == 16384
    )
    assert (
        sample(
            "hami_resource_quota_used",
            {"namespace": "ns", "quota_name": "nvidia.com/gpucores", "limit": "50"},
        )
        == 20
    )
    assert (
        sample("hami_resource_quota_limit", {"namespace": "other", "quota_name": "nvidia.com/gpumem"}) is None
    )


def test_the_model_charges_namespaces_from_watched_pods() -> None:
    """A pod bound by anyone (its allocation annotation) is charged to its namespace; its end frees it."""
    model = ClusterModel()
    model.replace_nodes([gpu_node("n", [gpu("A", 0)], ours=True)])
    model.replace_pods([])
    bound = gpu_pod("p", container(gpu=1, gpumem=3000), node_name="n", phase="Running")
    bound["metadata"]["annotations"][keys.DEVICES_ALLOCATED] = "A,NVIDIA,3000,0:;"
    model.apply_pod("ADDED", bound)
    assert model.namespace_usage == {"ns": [3000, 0]}
    bound["status"]["phase"] = "Succeeded"
    model.apply_pod("MODIFIED", bound)
    assert model.namespace_usage == {}
