"""Preemption by fraction: which lower-priority pods to remove so a pod fits a GPU
(docs/extender.md#preemption).

kube-scheduler's own preemption cannot see GPU memory or cores (the extender's resources are
``ignoredByScheduler``), so on its own it finds no victims for a pod that waits for a fraction of
a GPU. This module chooses them from the model, as kube-scheduler's DefaultPreemption chooses its
own, per node:

1. the candidates are the pods allocated on the node whose priority is lower than the preemptor's
   and which are not leaving already (a pod being deleted frees its GPUs by itself: its usage is
   not counted, and it is never a victim);
2. with every candidate gone, the preemptor must fit (``fit_pod`` over what is left) and pass its
   namespace's quota (the victims of its own namespace no longer charged); else the node is out;
3. then candidates are reprieved one by one, those whose eviction would violate a
   PodDisruptionBudget first, then by priority (highest first) and size (smallest first, so the
   victims are the fewest large pods rather than many small ones): a candidate that can be put back
   with the preemptor still fitting is kept. What is left are the victims.

Across nodes the plan with the fewest PDB violations wins, then the lowest highest victim
priority, the smallest priority sum, the fewest victims, then the node name (kube-scheduler's
``pickOneNodeForPreemption`` order, less start times). A pod of equal or higher priority is never a
victim, and neither is a pod whose GPUs are reserved or being bound, nor one of another scheduler's
in-flight binds: only pods the model has as allocated. A plan with no victims means pods already
leaving make room: the preemptor waits for them.

Pure: reads the model, decides nothing by itself (``hamipy.extender.eviction`` carries a plan out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from hamipy.extender.disruption_budgets import DisruptionBudgets
from hamipy.extender.fitting import PodAsk, fit_pod
from hamipy.extender.model import (
    ClusterModel,
    Contribution,
    NodeName,
    NodeState,
    PodUid,
    charge_of,
    pod_priority,
    pod_usage,
)
from hamipy.protocol.devices import PodDevices
from hamipy.protocol.mig_allocations import MigAllocation

__all__ = [
    "PREEMPTING",
    "Plan",
    "Preemptor",
    "choose_plan",
    "plan_node",
    "preemptor_of",
]

PREEMPTING: Final = "Preempting"
"""The reason of a filter that failed but started a preemption for the pod (and of its Event)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Preemptor:
    """A pending pod that may preempt: who it is, its priority and its asks."""

    uid: PodUid
    namespace: str
    name: str
    priority: int
    ask: PodAsk


def preemptor_of(uid: PodUid, pod: Mapping[str, Any], ask: PodAsk) -> Preemptor | None:
    """The pod as a preemptor, or None when ``spec.preemptionPolicy`` is ``Never``."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if spec.get("preemptionPolicy") == "Never":
        return None
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    return Preemptor(uid, namespace, name, pod_priority(pod), ask)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What preempting on ``node`` takes: ``victims`` (the GPU pods to evict, by namespace and
    name; their ``priorities`` in the same order), ``others`` (pods kube-scheduler chose for its
    own resources that hold no GPU here, evicted too), where the preemptor then fits (``devices``)
    and how many victims a PodDisruptionBudget would miss."""

    node: NodeName
    victims: tuple[Contribution, ...]
    priorities: tuple[int, ...]
    devices: PodDevices
    pdb_violations: int
    others: tuple[PodUid, ...] = ()

    def rank(self) -> tuple[int, int, int, int, str]:
        top = max(self.priorities, default=-(2**31))
        return (
            self.pdb_violations,
            top,
            sum(self.priorities),
            len(self.victims) + len(self.others),
            self.node,
        )


def choose_plan(plans: Iterable[Plan]) -> Plan | None:
    """The node to preempt on (the module docstring's order); None when there is none."""
    return min(plans, key=Plan.rank, default=None)


def _violating(
    candidates: Sequence[Contribution], model: ClusterModel, budgets: DisruptionBudgets
) -> set[PodUid]:
    """The candidates whose eviction a PodDisruptionBudget does not allow, counted in order as
    kube-scheduler's ``filterPodsWithPDBViolation`` counts them."""
    allowance: dict[str, dict[str, int]] = {}
    out: set[PodUid] = set()
    for c in candidates:
        left = allowance.setdefault(c.namespace, budgets.allowance(c.namespace))
        if not left:
            continue
        for name in budgets.matching(c.namespace, model.facts[c.uid].labels):
            left[name] -= 1
            if left[name] < 0:
                out.add(c.uid)
    return out


# -- the plan on one node --------------------------------------------------------------------------


def plan_node(
    model: ClusterModel,
    state: NodeState,
    preemptor: Preemptor,
    *,
    required: Iterable[PodUid] = (),
) -> Plan | None:
    """The victims on ``state``'s node that let ``preemptor`` fit (the module docstring's steps);
    None when evicting every lower-priority pod would not do. ``required``: pods already chosen
    (by kube-scheduler, for its own resources), evicted whatever this plan finds."""
    index = {g.uuid: i for i, g in enumerate(state.gpus)}
    held = [[g.used_slots, g.used_mem, g.used_cores] for g in state.gpus]
    freed: list[MigAllocation] = []  # the MIG instances of the pods taken away

    def remove(c: Contribution, sign: int) -> None:
        for uuid, usage in c.usage.items():
            i = index.get(uuid)
            if i is not None:
                for k in range(3):
                    held[i][k] -= sign * usage[k]
        for allocation in c.mig:
            if sign > 0:
                freed.append(allocation)
            else:
                freed.remove(allocation)

    required = set(required)
    candidates: list[Contribution] = []
    forced: list[Contribution] = []
    gone: list[Contribution] = []  # leaving, forced or candidates: not held while planning
    for c in model.pods_on(state.name):
        facts = model.facts.get(c.uid)
        if c.source != "allocated" or facts is None or c.uid == preemptor.uid:
            continue
        if facts.leaving:
            pass  # frees its GPUs by itself
        elif c.uid in required:
            forced.append(c)
        elif facts.priority < preemptor.priority:
            candidates.append(c)
        else:
            continue
        remove(c, 1)
        gone.append(c)
    if not candidates and not forced:
        return None  # nothing to evict here (this keeps a failed filter's extra cost to a scan)
    quota_used = model.used_by(preemptor.namespace, exclude=preemptor.uid)
    own = [0, 0]
    for c in gone:
        if c.namespace == preemptor.namespace:
            mem, cores = charge_of(c.usage)
            own[0] += mem
            own[1] += cores

    def fits() -> PodDevices | None:
        fit = fit_pod(state, preemptor.ask, held=held, freed=freed)
        if fit.devices is None:
            return None
        asked = charge_of(pod_usage(fit.devices, preemptor.ask.n_init, preemptor.ask.sidecars))
        used = (quota_used[0] - own[0], quota_used[1] - own[1])
        if model.quotas.refusal(preemptor.namespace, used=used, asked=asked) is not None:
            return None
        return fit.devices

    if fits() is None:
        return None
    violating = _violating(candidates, model, model.budgets)
    order = sorted(
        candidates,
        key=lambda c: (
            c.uid not in violating,
            -model.facts[c.uid].priority,
            charge_of(c.usage)[0],
            c.namespace,
            c.name,
        ),
    )
    victims: list[Contribution] = []
    for c in order:
        remove(c, -1)
        charged = charge_of(c.usage) if c.namespace == preemptor.namespace else (0, 0)
        own[0] -= charged[0]
        own[1] -= charged[1]
        if fits() is None:  # it must go
            remove(c, 1)
            own[0] += charged[0]
            own[1] += charged[1]
            victims.append(c)
    devices = fits()
    if devices is None:  # cannot happen: every step kept the preemptor fitting
        return None
    chosen = tuple(sorted([*forced, *victims], key=lambda c: (c.namespace, c.name)))
    return Plan(
        node=state.name,
        victims=chosen,
        priorities=tuple(model.facts[c.uid].priority for c in chosen),
        devices=devices,
        pdb_violations=sum(1 for c in chosen if c.uid in violating),
        others=tuple(sorted(required - {c.uid for c in forced})),
    )
