"""Register entries the scheduler refuses (``hamipy.extender.gpu_claims``): a GPU UUID another,
older node registers already, and a GPU registered with 0 MiB. A tenant cannot write node
annotations, but a misconfigured or compromised device plugin can: such an entry is never offered,
an Event on the node and a log line say why, and one physical GPU is never booked twice through
two nodes. When the owning node goes, the other node's entry is offered, with every pod on that GPU
counted."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence

import pytest
from builders import container, gpu, gpu_node, gpu_pod, running_pod
from extender_fakes import BIND_SETTINGS, bind_rig

from hamipy.extender.errors import BindRefused
from hamipy.extender.filtering import build_ask, decide
from hamipy.extender.gpu_claims import DUPLICATE_UUID, ZERO_MEMORY
from hamipy.extender.invariant import check_objects
from hamipy.extender.model import ClusterModel, Problem
from hamipy.extender.telemetry import Telemetry
from hamipy.extender.watching import GPU_REFUSED, report_problems
from hamipy.kube.client import NullKube
from hamipy.kube.events import EventRecorder
from hamipy.kube.resources import pod_path
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.identifiers import NodeName, PodUid

OLDER = "2026-01-01T00:00:00Z"
NEWER = "2026-06-01T00:00:00Z"


def refused(model: ClusterModel, node_name: str) -> dict[str, str | None]:
    return {g.uuid: g.refused for g in model.nodes[NodeName(node_name)].gpus}


def chosen(model: ClusterModel, names: Sequence[str], mem: int = 1000) -> tuple[str | None, list[str]]:
    """The node and GPUs a filter chooses for a pod asking one GPU and ``mem`` MiB."""
    ask = build_ask(gpu_pod("q", container(gpu=1, gpumem=mem)), Config())
    decision = decide(model, ask, [NodeName(n) for n in names], now=0.0)
    uuids = [d.uuid for slot in decision.devices or [] for d in slot]
    return decision.node, uuids


def test_a_gpu_registered_with_0_mib_is_refused_and_the_nodes_other_gpus_are_offered() -> None:
    model = ClusterModel()
    problems = model.apply_node("ADDED", gpu_node("n", [gpu("Z", 0, mem=0), gpu("A", 1)]))
    assert refused(model, "n") == {"Z": ZERO_MEMORY, "A": None}
    (problem,) = problems
    assert (problem.name, problem.uid, problem.refused) == ("n", "uid-n", True)
    assert "GPU Z (index 0) is not scheduled: it is registered with 0 MiB" in problem.reason
    # A pod asking a percentage (0 % of 0 MiB fits in 0 MiB) or nothing but a GPU never lands on Z.
    for mem_ask in (container(gpu=1), container(gpu=1, gpumem_percentage=10)):
        decision = decide(model, build_ask(gpu_pod("q", mem_ask), Config()), [NodeName("n")], now=0.0)
        assert [d.uuid for slot in decision.devices or [] for d in slot] == ["A"]
    # The same register again reports nothing new.
    changed = gpu_node("n", [gpu("Z", 0, mem=0), gpu("A", 1, count=5)])
    assert model.apply_node("MODIFIED", changed) == []


def test_a_new_refusal_names_every_gpu_refused_on_the_node() -> None:
    """A node has one ``GPURefused`` Event, whose message each new refusal replaces: it names every
    GPU refused there, not only the one refused last."""
    model = ClusterModel()
    model.apply_node(
        "ADDED", gpu_node("new", [gpu("Z", 0, mem=0), gpu("X", 1), gpu("A", 2)], created=NEWER, ours=True)
    )
    (problem,) = model.apply_node("ADDED", gpu_node("old", [gpu("X", 0)], created=OLDER, ours=True))
    assert problem.name == "new"
    assert problem.reason == "; ".join(
        [
            "GPU Z (index 0) is not scheduled: it is registered with 0 MiB of memory, the size every "
            "slice is cut from",
            "GPU X (index 1) is not scheduled: node old registers the same GPU UUID and its Node is "
            "older; one GPU is never offered through two nodes, and the pods bound here on it count "
            "against old's",
        ]
    )


def test_a_node_of_only_0_mib_gpus_fits_nothing_and_says_why() -> None:
    model = ClusterModel()
    model.apply_node("ADDED", gpu_node("n", [gpu("Z", 0, mem=0)]))
    decision = decide(model, build_ask(gpu_pod("q"), Config()), [NodeName("n")], now=0.0)
    assert decision.node is None
    assert "CardRefused" in decision.unresolvable[NodeName("n")].text()


@pytest.mark.parametrize("order", ["older-first", "newer-first", "listed"])
def test_a_uuid_two_nodes_register_is_offered_only_through_the_older_node(order: str) -> None:
    old = gpu_node("b-old", [gpu("X", 0)], created=OLDER, ours=True)
    new = gpu_node("a-new", [gpu("X", 0), gpu("Y", 1)], created=NEWER, ours=True)
    model = ClusterModel()
    if order == "listed":  # a list comes in name order: the newer node first
        problems = model.replace_nodes([new, old])
    else:
        first, second = (old, new) if order == "older-first" else (new, old)
        problems = model.apply_node("ADDED", first) + model.apply_node("ADDED", second)
    assert refused(model, "b-old") == {"X": None}
    assert refused(model, "a-new") == {"X": DUPLICATE_UUID, "Y": None}
    (problem,) = problems
    assert (problem.name, problem.uid, problem.refused) == ("a-new", "uid-a-new", True)
    assert "GPU X (index 0) is not scheduled: node b-old registers the same GPU UUID" in problem.reason
    assert chosen(model, ["a-new"]) == ("a-new", ["Y"])
    metrics = Telemetry.create(stream=io.StringIO()).metrics
    metrics.attach(model)
    for reason, count in ((DUPLICATE_UUID, 1), (ZERO_MEMORY, 0)):
        sample = metrics.registry.get_sample_value("hamipy_extender_gpus_refused", {"reason": reason})
        assert sample == count


def test_pods_on_the_refused_entry_count_against_the_owners_gpu() -> None:
    """The newer node registered X first and has a pod on it; then the older node registers X too
    and owns it: that pod runs on the same GPU, so the older node's X has that much less."""
    model = ClusterModel()
    model.replace_nodes([gpu_node("new", [gpu("X", 0, count=2, mem=2000)], created=NEWER, ours=True)])
    model.replace_pods([running_pod("p", allocated="X,NVIDIA,1500,0:;", node="new")])
    model.apply_node("ADDED", gpu_node("old", [gpu("X", 0, count=2, mem=2000)], created=OLDER, ours=True))
    (x_old,) = model.nodes[NodeName("old")].gpus
    assert (x_old.used_slots, x_old.used_mem) == (1, 1500)
    assert chosen(model, ["old", "new"], mem=1000) == (None, [])
    assert chosen(model, ["old"], mem=500) == ("old", ["X"])
    # The pod on the duplicate goes: the owner's X is free again.
    model.apply_pod("DELETED", running_pod("p", allocated="X,NVIDIA,1500,0:;", node="new"))
    assert (x_old.used_slots, x_old.used_mem) == (0, 0)


@pytest.mark.parametrize("how", ["deleted", "unregistered", "relisted"])
def test_when_the_owner_goes_the_other_nodes_entry_is_offered_with_every_pod_counted(how: str) -> None:
    model = ClusterModel()
    old = gpu_node("old", [gpu("X", 0, count=4, mem=4000)], created=OLDER, ours=True)
    new = gpu_node("new", [gpu("X", 0, count=4, mem=4000)], created=NEWER, ours=True)
    model.replace_nodes([old, new])
    model.replace_pods(
        [
            running_pod("a", allocated="X,NVIDIA,1000,0:;", node="old"),
            running_pod("b", allocated="X,NVIDIA,500,0:;", node="new"),
        ]
    )
    freed: list[str | None] = []
    model.on_freed = freed.append
    (x_old,), (x_new,) = model.nodes[NodeName("old")].gpus, model.nodes[NodeName("new")].gpus
    assert (x_old.used_mem, x_new.used_mem) == (1500, 500)
    assert model.refused_gpus(DUPLICATE_UUID) == 1
    if how == "deleted":
        model.apply_node("DELETED", old)
    elif how == "unregistered":
        model.apply_node("MODIFIED", gpu_node("old", [gpu("W", 0)], created=OLDER, ours=True))
    else:
        model.replace_nodes([new])
    assert refused(model, "new") == {"X": None}
    (x_new,) = model.nodes[NodeName("new")].gpus
    # b's 500 MiB; a (bound to the old node) counts where its node is, if that is still there.
    assert x_new.used_mem == 500
    assert "new" in freed
    assert chosen(model, ["new"]) == ("new", ["X"])
    assert model.refused_gpus(DUPLICATE_UUID) == 0


def test_a_duplicates_register_changing_leaves_the_owners_usage_as_it_is() -> None:
    """Each change of the younger node's register re-forms the UUID's claim: its pods' usage leaves
    the owner's entry and is added again, never twice."""
    model = ClusterModel()
    model.replace_nodes(
        [
            gpu_node("old", [gpu("X", 0, count=4, mem=4000)], created=OLDER, ours=True),
            gpu_node("new", [gpu("X", 0, count=4, mem=4000)], created=NEWER, ours=True),
        ]
    )
    model.replace_pods(
        [
            running_pod("a", allocated="X,NVIDIA,1000,0:;", node="old"),
            running_pod("b", allocated="X,NVIDIA,500,0:;", node="new"),
        ]
    )
    for count in (5, 6, 7):
        model.apply_node(
            "MODIFIED", gpu_node("new", [gpu("X", 0, count=count, mem=4000)], created=NEWER, ours=True)
        )
    (x_old,), (x_new,) = model.nodes[NodeName("old")].gpus, model.nodes[NodeName("new")].gpus
    assert (x_old.used_slots, x_old.used_mem) == (2, 1500)
    assert (x_new.used_slots, x_new.used_mem, x_new.refused) == (1, 500, DUPLICATE_UUID)


def test_a_node_re_created_under_its_name_is_younger_though_only_a_re_list_shows_it() -> None:
    """A Node deleted and created again under the same name while the watch was down comes back
    only in the re-list, its register unchanged: it is a new Node, younger than the other node
    registering the UUID, which owns it from then on."""
    model = ClusterModel()
    model.replace_nodes(
        [
            gpu_node("a", [gpu("X", 0)], created=OLDER, ours=True),
            gpu_node("b", [gpu("X", 0)], created=NEWER, ours=True),
        ]
    )
    assert (refused(model, "a"), refused(model, "b")) == ({"X": None}, {"X": DUPLICATE_UUID})
    model.replace_nodes(
        [
            gpu_node("a", [gpu("X", 0)], created="2026-09-01T00:00:00Z", ours=True),
            gpu_node("b", [gpu("X", 0)], created=NEWER, ours=True),
        ]
    )
    assert (refused(model, "a"), refused(model, "b")) == ({"X": DUPLICATE_UUID}, {"X": None})


def test_a_refused_entry_never_fits_where_a_full_one_of_the_same_shape_may() -> None:
    """Whether a node could fit the pod if it were empty is worked out once per GPU shape: a refused
    entry is a shape of its own. The owner's full X fails the pod for now (kube-scheduler may preempt
    there); the duplicate of it never fits, so it is unresolvable."""
    model = ClusterModel()
    model.replace_nodes(
        [
            gpu_node("old", [gpu("X", 0, mem=2000)], created=OLDER, ours=True),
            gpu_node("new", [gpu("X", 0, mem=2000)], created=NEWER, ours=True),
        ]
    )
    model.replace_pods([running_pod("p", allocated="X,NVIDIA,2000,0:;", node="old")])
    decision = decide(model, build_ask(gpu_pod("q"), Config()), [NodeName("old"), NodeName("new")], now=0.0)
    assert (list(decision.failed), list(decision.unresolvable)) == (["old"], ["new"])


def test_a_0_mib_entry_claims_nothing() -> None:
    """A GPU refused for 0 MiB does not keep another node's healthy entry for it from counting."""
    model = ClusterModel()
    model.replace_nodes(
        [
            gpu_node("old", [gpu("X", 0, mem=0)], created=OLDER, ours=True),
            gpu_node("new", [gpu("X", 0)], created=NEWER, ours=True),
        ]
    )
    assert refused(model, "old") == {"X": ZERO_MEMORY}
    assert refused(model, "new") == {"X": None}


async def test_the_locked_bind_refuses_a_duplicate_and_counts_the_owners_twins() -> None:
    """A bind that decides under the node lock from the Node and its pods read afresh still knows
    what other nodes register: the duplicate is never chosen, and the owner's GPU counts the pods
    bound on the other node's entry for it."""
    r = bind_rig(
        BIND_SETTINGS,
        gpu_node("old", [gpu("X", 0, count=2, mem=2000)], created=OLDER),
        gpu_node("new", [gpu("X", 0, count=2, mem=2000), gpu("Y", 1, count=2, mem=500)], created=NEWER),
    )
    r.kube.add(running_pod("twin", allocated="X,NVIDIA,500,0:;", node="new"))
    r.model.replace_pods(r.kube.items(pod_path()))
    # The duplicate X on new has 1500 MiB free, Y too little: p fits only if X were offered.
    r.kube.add(gpu_pod("p", container(gpu=1, gpumem=1000)))
    with pytest.raises(BindRefused, match="CardRefused"):
        await r.binder.bind(namespace="ns", name="p", uid=PodUid("uid-ns-p"), node=NodeName("new"))
    assert "nodeName" not in r.kube.pod("ns", "p")["spec"]
    # The owner's X has 2000 MiB less the twin's 500.
    r.kube.add(gpu_pod("q", container(gpu=1, gpumem=1600)))
    with pytest.raises(BindRefused, match="CardInsufficientMemory"):
        await r.binder.bind(namespace="ns", name="q", uid=PodUid("uid-ns-q"), node=NodeName("old"))
    r.kube.add(gpu_pod("s", container(gpu=1, gpumem=1500)))
    await r.binder.bind(namespace="ns", name="s", uid=PodUid("uid-ns-s"), node=NodeName("old"))


def test_a_refused_gpu_is_logged_and_reported_on_its_node() -> None:
    log = io.StringIO()
    telemetry = Telemetry.create(stream=log)
    events = EventRecorder(NullKube(), component="hamipy-extender", logger=telemetry.logger)
    reason = "GPU X (index 0) is not scheduled: node old registers the same GPU UUID"
    report_problems(
        [Problem("Node", "new", "", "uid-new", keys.NODE_REGISTER, keys.NODE_REGISTER, reason, refused=True)],
        telemetry,
        events,
    )
    (line,) = [json.loads(entry) for entry in log.getvalue().splitlines()]
    assert (line["event"], line["node"], line["error"]) == ("GPU refused; it is not offered", "new", reason)
    (pending,) = events.recorded
    assert (pending.involved["kind"], pending.involved["name"], pending.reason) == (
        "Node",
        "new",
        GPU_REFUSED,
    )
    assert (pending.message, pending.warning) == (reason, True)


def test_the_invariant_counts_a_uuid_two_nodes_register_as_one_gpu() -> None:
    nodes = [
        gpu_node("old", [gpu("X", 0, count=2, mem=2000)], created=OLDER),
        gpu_node("new", [gpu("X", 0, count=2, mem=2000)], created=NEWER),
    ]
    fits = check_objects(
        nodes,
        [
            running_pod("a", allocated="X,NVIDIA,1000,0:;", node="old"),
            running_pod("b", allocated="X,NVIDIA,1000,0:;", node="new"),
        ],
    )
    assert fits.ok, fits.violations
    over = check_objects(
        nodes,
        [
            running_pod("a", allocated="X,NVIDIA,1500,0:;", node="old"),
            running_pod("b", allocated="X,NVIDIA,1000,0:;", node="new"),
        ],
    )
    (violation,) = over.violations
    assert (violation.node, violation.device, violation.what) == ("old+new", "X", "memory")
    assert (violation.allocated, violation.capacity) == (2500, 2000)
