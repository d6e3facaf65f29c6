"""Preemption by fraction: the fewest lower-priority pods whose removal lets a
pod fit a GPU by memory, cores and slots; never a pod of equal or higher priority; PodDisruptionBudgets
and quotas counted; carried out by the filter (victims marked and deleted, Events, the preemptor's
GPUs held) and offered to kube-scheduler's preemption verb."""

from __future__ import annotations

from typing import Any

import pytest
from builders import container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_rig, filter_args, preempt_args

from hamipy.extender.disruption_budgets import selector_matches
from hamipy.extender.filtering import build_ask
from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.preemption import PREEMPTING, Plan, choose_plan, plan_node, preemptor_of
from hamipy.extender.quota import QUOTA_EXCEEDED
from hamipy.protocol import keys
from hamipy.protocol.config import Config

GIB = 1024


def running(
    name: str, uuid: str, mib: int, *, priority: int = 0, namespace: str = "ns", node: str = "n", **extra: Any
) -> dict[str, Any]:
    """A bound, running pod holding ``mib`` of GPU ``uuid``, at ``priority``."""
    p = gpu_pod(name, container(gpu=1, gpumem=mib), namespace=namespace, node_name=node, phase="Running")
    p["metadata"]["annotations"][keys.DEVICES_ALLOCATED] = f"{uuid},NVIDIA,{mib},0:;"
    p["spec"]["priority"] = priority
    for key, value in extra.items():
        if key == "labels":
            p["metadata"]["labels"] = value
        else:
            p["spec"][key] = value
    return p


def pending(
    name: str, mib: int, *, priority: int = 1000, namespace: str = "ns", **spec: Any
) -> dict[str, Any]:
    p = gpu_pod(name, container(gpu=1, gpumem=mib), namespace=namespace)
    p["spec"].update(priority=priority, **spec)
    return p


def model_with(gpus: int, *pods: dict[str, Any], mem: int = 80 * GIB, slots: int = 10) -> ClusterModel:
    model = ClusterModel()
    model.replace_nodes(
        [gpu_node("n", [gpu(f"G{i}", i, mem=mem, count=slots) for i in range(gpus)], ours=True)]
    )
    model.replace_pods(pods)
    return model


def plan_for(model: ClusterModel, p: dict[str, Any]) -> Plan | None:
    preemptor = preemptor_of(PodUid(p["metadata"]["uid"]), p, build_ask(p, Config()))
    assert preemptor is not None
    return plan_node(model, model.nodes[NodeName("n")], preemptor)


def victims(plan: Plan | None) -> list[str]:
    assert plan is not None
    return [v.name for v in plan.victims]


# ---- choosing victims


def test_exactly_enough_slices_on_one_gpu_make_room() -> None:
    """Two full GPUs of four 20 GiB low-priority slices each: a 40 GiB pod evicts two, on one GPU."""
    pods = [running(f"low-{g}{i}", f"G{g}", 20 * GIB) for g in range(2) for i in range(4)]
    plan = plan_for(model_with(2, *pods), pending("big", 40 * GIB))
    assert plan is not None
    assert len(plan.victims) == 2
    (gpu_uuid,) = {uuid for v in plan.victims for uuid in v.usage}
    assert [d.uuid for d in plan.devices[0]] == [gpu_uuid]
    assert plan.pdb_violations == 0


def test_one_large_victim_rather_than_many_small() -> None:
    pods = [running("large", "G0", 40 * GIB), *(running(f"small{i}", "G0", 10 * GIB) for i in range(4))]
    assert victims(plan_for(model_with(1, *pods), pending("big", 40 * GIB))) == ["large"]


def test_equal_or_higher_priority_is_never_a_victim() -> None:
    equal = [running(f"peer{i}", "G0", 40 * GIB, priority=1000) for i in range(2)]
    assert plan_for(model_with(1, *equal), pending("big", 40 * GIB)) is None
    mixed = [running("vip", "G0", 40 * GIB, priority=2000), running("low", "G0", 40 * GIB)]
    assert victims(plan_for(model_with(1, *mixed), pending("big", 40 * GIB))) == ["low"]
    # Only the high-priority pod's slice would make room: nothing to do.
    blocked = [running("vip", "G0", 60 * GIB, priority=2000), running("low", "G0", 20 * GIB)]
    assert plan_for(model_with(1, *blocked), pending("big", 40 * GIB)) is None


def test_cores_and_slots_count_as_well_as_memory() -> None:
    cores = [running(f"c{i}", "G0", 1 * GIB) for i in range(2)]
    for i, p in enumerate(cores):
        p["metadata"]["annotations"][keys.DEVICES_ALLOCATED] = f"G0,NVIDIA,{GIB},{60 if i == 0 else 30}:;"
    hungry = pending("hungry", GIB)
    hungry["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpucores"] = "50"
    assert victims(plan_for(model_with(1, *cores), hungry)) == ["c0"]  # 30 + 50 fits; 60 + 50 not
    # A GPU split two ways with both slots taken: one slice goes, however little it holds.
    slots = [running("s0", "G0", GIB), running("s1", "G0", GIB)]
    assert len(victims(plan_for(model_with(1, *slots, slots=2), pending("small", GIB)))) == 1


def test_a_pod_that_may_not_preempt_or_cannot_fit_gets_no_plan() -> None:
    low = [running("low", "G0", 80 * GIB)]
    never = pending("polite", 40 * GIB, preemptionPolicy="Never")
    assert preemptor_of(PodUid(never["metadata"]["uid"]), never, build_ask(never, Config())) is None
    assert plan_for(model_with(1, *low), pending("huge", 100 * GIB)) is None


def test_pods_already_leaving_are_waited_for_not_evicted() -> None:
    leaving = running("leaving", "G0", 40 * GIB)
    leaving["metadata"]["deletionTimestamp"] = "2026-11-24T00:00:00Z"
    plan = plan_for(model_with(1, leaving, running("low", "G0", 40 * GIB)), pending("big", 40 * GIB))
    assert plan is not None
    assert plan.victims == ()


def test_a_pod_disruption_budget_is_respected_where_another_victim_does_instead() -> None:
    guarded = running("guarded", "G0", 40 * GIB, labels={"app": "db"})
    free = running("free", "G1", 40 * GIB)
    model = model_with(
        2,
        guarded,
        running("x", "G0", 40 * GIB, priority=5000),
        free,
        running("y", "G1", 40 * GIB, priority=5000),
    )
    pdb = {
        "metadata": {"namespace": "ns", "name": "db"},
        "spec": {"selector": {"matchLabels": {"app": "db"}}},
        "status": {"disruptionsAllowed": 0},
    }
    model.budgets.apply("ADDED", pdb)
    plan = plan_for(model, pending("big", 40 * GIB))
    assert victims(plan) == ["free"]
    assert plan is not None
    assert plan.pdb_violations == 0
    # With no other way, the budget is violated (as kube-scheduler does) and the plan says so.
    model = model_with(1, guarded, running("x", "G0", 40 * GIB, priority=5000))
    model.budgets.apply("ADDED", pdb)
    plan = plan_for(model, pending("big", 40 * GIB))
    assert victims(plan) == ["guarded"]
    assert plan is not None
    assert plan.pdb_violations == 1


def test_the_node_with_fewer_budget_violations_then_lower_victims_wins() -> None:
    def plan(node: str, violations: int, *priorities: int) -> Plan:
        return Plan(node=node, victims=(), priorities=priorities, devices=[], pdb_violations=violations)  # type: ignore[arg-type]

    best = choose_plan([plan("a", 1, 0), plan("b", 0, 100), plan("c", 0, 10, 10), plan("d", 0, 10)])
    assert best is not None
    assert best.node == "d"


def test_the_quota_counts_in_the_choice() -> None:
    """Room on the GPU, but the namespace is at its quota: a victim of its own namespace frees it."""
    model = model_with(
        1, running("other-team", "G0", 20 * GIB, namespace="b"), running("mine", "G0", 20 * GIB)
    )
    model.quotas.replace(
        [
            {
                "metadata": {"namespace": "ns", "name": "gpu"},
                "spec": {"hard": {"limits.nvidia.com/gpumem": "40960"}},
            }
        ]
    )
    assert victims(plan_for(model, pending("big", 40 * GIB))) == ["mine"]


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ({}, {"a": "1"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
        ({"matchExpressions": [{"key": "a", "operator": "Sideways"}]}, {"a": "1"}, False),
    ],
)
def test_label_selectors_match_as_kubernetes_does(
    selector: dict[str, Any], labels: dict[str, str], matches: bool
) -> None:
    assert selector_matches(selector, labels) is matches


# ---- the filter carries it out


def deleted(r: BindRig) -> list[str]:
    """The pods the extender deleted, and the API server with them."""
    return sorted(p.rsplit("/", 1)[1] for m, p in r.kube.calls if m == "DELETE" and p not in r.kube.objects)


def preemption_rig(*pods: dict[str, Any]) -> BindRig:
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("G0", 0, mem=80 * GIB)], ours=True))
    for p in pods:
        r.add_watched_pod(p)
    return r


async def test_the_filter_evicts_the_victims_holds_the_gpu_and_says_so() -> None:
    r = preemption_rig(*(running(f"low{i}", "G0", 20 * GIB) for i in range(4)))
    big = pending("big", 40 * GIB)
    r.add_watched_pod(big)
    answer = r.scheduler.filter(filter_args(big, ["n"]))
    assert answer["NodeNames"] == []
    assert answer["FailedNodes"]["n"].startswith(f"{PREEMPTING}: preempting ns/low")
    # The preemptor's GPU is held at once: a low-priority pod filtered meanwhile does not get it.
    assert r.model.contributions[PodUid("uid-ns-big")].source == "reserved"
    assert r.evictor is not None
    await r.evictor.idle()
    gone = deleted(r)
    assert len(gone) == 2
    assert r.kube.pod("ns", "big")["status"]["nominatedNodeName"] == "n"
    messages = [(e.reason, e.message) for e in r.events.recorded]
    assert (
        "Preempted",
        "Preempted by pod ns/big (priority 1000) on node n: it needed this pod's GPU memory or cores",
    ) in messages
    assert any(reason == PREEMPTING and "ns/low" in message for reason, message in messages)
    # While the victims stop, the pod waits, its GPU still held; nothing more is evicted.
    waiting = r.scheduler.filter(filter_args(big, ["n"]))
    assert "waiting for 2 preempted pod(s) to stop" in waiting["FailedNodes"]["n"]
    assert len(deleted(r)) == 2
    # Once they are gone, their room is the preemptor's: a low-priority pod does not get it.
    for name in gone:
        r.model.apply_pod("DELETED", running(name, "G0", 20 * GIB))
    sneaky = pending("sneaky", 20 * GIB, priority=0)
    r.add_watched_pod(sneaky)
    assert r.scheduler.filter(filter_args(sneaky, ["n"]))["NodeNames"] == []
    assert r.scheduler.filter(filter_args(big, ["n"]))["NodeNames"] == ["n"]
    assert PodUid("uid-ns-big") not in r.model.nominations


async def test_equal_priorities_never_preempt_through_the_filter() -> None:
    r = preemption_rig(*(running(f"peer{i}", "G0", 40 * GIB, priority=1000) for i in range(2)))
    big = pending("big", 40 * GIB)
    r.add_watched_pod(big)
    answer = r.scheduler.filter(filter_args(big, ["n"]))
    assert PREEMPTING not in answer["FailedNodes"]["n"]
    assert deleted(r) == []
    assert PodUid("uid-ns-big") not in r.model.contributions


async def test_a_failed_eviction_drops_the_preemption() -> None:
    from hamipy.kube.errors import KubeError

    r = preemption_rig(running("low", "G0", 80 * GIB))
    r.kube.fail(KubeError("refused", status=500), "DELETE", "/api/v1/namespaces/ns/pods/low")
    big = pending("big", 40 * GIB)
    r.add_watched_pod(big)
    r.scheduler.filter(filter_args(big, ["n"]))
    assert r.evictor is not None
    await r.evictor.idle()
    assert PodUid("uid-ns-big") not in r.model.nominations
    assert PodUid("uid-ns-big") not in r.model.contributions
    assert "preemption failed" in r.log.getvalue()


# ---- kube-scheduler's preemption verb


def test_the_verb_adds_the_gpu_victims_to_kube_schedulers_and_drops_nodes_that_cannot_help() -> None:
    r = preemption_rig(
        running("low0", "G0", 40 * GIB), running("low1", "G0", 40 * GIB), running("cpu", "G0", 0)
    )
    big = pending("big", 40 * GIB)
    r.add_watched_pod(big)
    answer = r.scheduler.preempt(
        preempt_args(
            {
                "Pod": big,
                "NodeNameToMetaVictims": {
                    "n": {"Pods": [{"UID": "uid-ns-cpu"}], "NumPDBViolations": 0},
                    "elsewhere": {"Pods": [{"UID": "x"}], "NumPDBViolations": 0},
                },
            }
        )
    )
    chosen = answer["NodeNameToMetaVictims"]
    assert list(chosen) == ["n"]
    uids = {p["UID"] for p in chosen["n"]["Pods"]}
    assert "uid-ns-cpu" in uids
    assert len(uids & {"uid-ns-low0", "uid-ns-low1"}) == 1


def test_quota_refusals_stay_named_when_nothing_can_be_preempted() -> None:
    r = preemption_rig(running("mine", "G0", 20 * GIB, priority=2000))
    r.model.quotas.replace(
        [
            {
                "metadata": {"namespace": "ns", "name": "gpu"},
                "spec": {"hard": {"limits.nvidia.com/gpumem": "30720"}},
            }
        ]
    )
    big = pending("big", 20 * GIB)
    r.add_watched_pod(big)
    answer = r.scheduler.filter(filter_args(big, ["n"]))
    assert answer["FailedNodes"]["n"].startswith(QUOTA_EXCEEDED)


async def test_each_victim_is_marked_as_kube_scheduler_marks_it_before_its_guarded_delete() -> None:
    r = preemption_rig(running("low", "G0", 80 * GIB))
    seen: list[tuple[str, str, Any]] = []

    def record(method: str, path: str, body: Any) -> None:
        if "/low" in path:
            seen.append((method, path, body))

    r.kube.on_request = record
    big = pending("big", 40 * GIB)
    r.add_watched_pod(big)
    r.scheduler.filter(filter_args(big, ["n"]))
    assert r.evictor is not None
    await r.evictor.idle()
    (patch_method, patch_path, patch), (delete_method, delete_path, delete) = seen
    assert (patch_method, patch_path) == ("PATCH", "/api/v1/namespaces/ns/pods/low/status")
    assert patch["metadata"] == {"uid": "uid-ns-low"}
    (condition,) = patch["status"]["conditions"]
    assert condition["type"] == "DisruptionTarget"
    assert condition["status"] == "True"
    assert condition["reason"] == "PreemptionByScheduler"
    assert (delete_method, delete_path) == ("DELETE", "/api/v1/namespaces/ns/pods/low")
    assert delete["preconditions"] == {"uid": "uid-ns-low"}
