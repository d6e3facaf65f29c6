"""The filter decision over many nodes (pure).

HAMi mode (``decide(..., all_feasible=False)``): nodes that pass a cheap summary check (usable,
enough GPUs with a free slot, enough memory and cores on the freest, a GPU type the pod accepts;
each O(1) from ``NodeState``'s summary) are taken in node-policy order (the model keeps that order,
``hamipy.extender.node_order``) and fitted best first; the first that fits is the choice. Nothing
else is checked or fitted on that path, which keeps a filter over a thousand nodes well under a
millisecond. A node whose lock another pod has held for longer than a bind waits
(``LockRule``) is passed over: a bind there would wait for it and time out
(docs/extender.md#stuck-locks). Only when no node fits is every node explained: its reasons
(``1/8 CardInsufficientMemory``) and whether it could never fit even empty (unresolvable).

Cooperative mode (``all_feasible=True``): every node is fitted and all that fit are returned with
their node scores, for ``/prioritize`` and kube-scheduler's own scoring.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

from hamipy.extender.explanations import Explained, Explanations
from hamipy.extender.fitting import Fit, NodeReasons, PodAsk, fit_pod
from hamipy.extender.model import (
    ClusterModel,
    NodeName,
    NodeState,
    PendingPod,
    PodUid,
    charge_of,
    pod_usage,
)
from hamipy.extender.quota import QUOTA_EXCEEDED
from hamipy.extender.scoring import GpuRule
from hamipy.protocol.config import Config
from hamipy.protocol.devices import PodDevices
from hamipy.protocol.pod_preferences import ScoringWeights, preferences_of, type_allowed
from hamipy.protocol.resources import pod_requests

__all__ = [
    "NODE_ALLOCATION_UNKNOWN",
    "NODE_HANDSHAKE_TIMEOUT",
    "NODE_LOCK_HELD",
    "NODE_REGISTER_MALFORMED",
    "NODE_UNREGISTERED",
    "Decision",
    "FailureSummary",
    "QuotaCheck",
    "ask_of",
    "build_ask",
    "decide",
    "quota_check",
    "summarize",
]

NODE_UNREGISTERED: Final = "NodeUnregistered"
NODE_REGISTER_MALFORMED: Final = "NodeRegisterMalformed"
NODE_ALLOCATION_UNKNOWN: Final = "NodeAllocationUnknown"
NODE_HANDSHAKE_TIMEOUT: Final = "NodeHandshakeTimeout"
NODE_LOCK_HELD: Final = "NodeLockHeld"


@dataclasses.dataclass(frozen=True, slots=True)
class LockRule:
    """Which node locks make a node unfit for ``pod``: held by another pod for longer than
    ``after_s`` (the bind's wait for a lock) and younger than ``expiry_s`` (``NodeState.lock_blocks``)."""

    pod: tuple[str, str]
    after_s: float
    expiry_s: float

    def blocks(self, node: NodeState, now: float) -> bool:
        return node.lock_blocks(now, after_s=self.after_s, expiry_s=self.expiry_s, pod=self.pod)


@dataclasses.dataclass(slots=True)
class Decision:
    """A filter's outcome: the chosen node and devices (HAMi mode), every feasible node (cooperative),
    and, for nodes that were explained, their reasons."""

    node: NodeName | None = None
    devices: PodDevices | None = None
    feasible: list[tuple[NodeName, PodDevices, float]] = dataclasses.field(default_factory=list)
    failed: dict[NodeName, NodeReasons] = dataclasses.field(default_factory=dict)
    """Nodes that do not fit now but could (kube-scheduler may preempt for them)."""
    unresolvable: dict[NodeName, NodeReasons] = dataclasses.field(default_factory=dict)
    """Nodes that could not fit the pod even empty."""
    fitted: int = 0
    """How many nodes got a full fit (the rest were ranked out or skipped by the summary check)."""
    quota: str | None = None
    """Why the namespace's quota refused a fit (then every node failed with it), or None."""


_ASK: Final = "ask"


def ask_of(pending: PendingPod, config: Config) -> PodAsk:
    """``build_ask`` of a watched pending pod, built once per version of the pod (its filters and
    its bind read the same asks), much of the building being the reading of quantities."""
    cached = pending.derived.get(_ASK)
    if cached is not None and cached[0] is config:
        ask: PodAsk = cached[1]
        return ask
    ask = build_ask(pending.pod, config)  # a ProtocolError is not kept: the pod is refused anyway
    pending.derived[_ASK] = (config, ask)
    return ask


def build_ask(pod: Mapping[str, Any], config: Config) -> PodAsk:
    """The pod's asks and preferences; raises ``ProtocolError`` on a malformed pod. The GPU policy
    chain is the pod's annotation, else the configured one, taken whole (as HAMi's
    ``GetGPUSchedulerPolicyByPod``)."""
    nv = config.nvidia
    prefs = preferences_of(pod)
    return PodAsk(
        requests=pod_requests(pod, names=nv.resource_names, defaults=nv.request_defaults),
        prefs=prefs,
        node_policy=prefs.node_policy or config.node_scheduler_policy,
        gpu_rule=GpuRule.of(prefs.gpu_policy or config.gpu_scheduler_policy),
        weights=prefs.scoring_weights or ScoringWeights(),
    )


QuotaCheck = Callable[[PodDevices], str | None]
"""Why the pod's namespace quota refuses these devices (``Quotas.refusal``), or None."""


def _refused(quota: QuotaCheck | None, devices: PodDevices, decision: Decision) -> bool:
    if quota is None:
        return False
    why = quota(devices)
    if why is not None:
        decision.quota = why
    return why is not None


def quota_check(model: ClusterModel, namespace: str, ask: PodAsk, uid: PodUid) -> QuotaCheck | None:
    """The check of ``namespace``'s GPU quotas for this pod's devices, against what its other pods
    hold (reserved and in flight included, ``uid``'s own left out); None when no quota limits it."""
    quotas = model.quotas
    if not quotas.limits(namespace):
        return None
    used = model.used_by(namespace, exclude=uid)

    def check(devices: PodDevices) -> str | None:
        asked = charge_of(pod_usage(devices, ask.n_init, ask.sidecars))
        return quotas.refusal(namespace, used=used, asked=asked)

    return check


def _types_ok(ask: PodAsk, type_key: tuple[str, ...], cache: dict[tuple[str, ...], bool]) -> bool:
    ok = cache.get(type_key)
    if ok is None:
        ok = any(type_allowed(ask.prefs, t) for t in type_key)
        cache[type_key] = ok
    return ok


_WALK_SHARE: Final = 8
"""Walk the model's kept node order when kube-scheduler sent at least 1/8 of the nodes: a node
passed over there costs a set lookup, ranking one sent name over ten times that
(``tests/bench/bench_extender.py``); with fewer names, ranking just those is cheaper."""


def decide(
    model: ClusterModel,
    ask: PodAsk,
    names: Iterable[NodeName],
    *,
    now: float,
    all_feasible: bool = False,
    locks: LockRule | None = None,
    quota: QuotaCheck | None = None,
    explained: Explanations | None = None,
) -> Decision:
    """Choose (or list) nodes among ``names`` for ``ask``; see the module docstring. With ``locks``,
    a node whose lock would keep the bind waiting until it times out is not chosen; with ``quota``,
    a fit the namespace's quota refuses is not either (when the pod's charge is the same on every
    node, the first refusal ends the search). With ``explained``, a node explained before for the
    same ask and not changed since is not fitted again (``hamipy.extender.explanations``)."""
    get = model.nodes.get
    decision = Decision()
    names = list(names)
    passes = _summary_check(ask, now, locks)
    if all_feasible:
        for name in names:
            node = get(name)
            if node is None or not passes(node):
                continue
            fit = fit_pod(node, ask)
            decision.fitted += 1
            if fit.devices is not None and not _refused(quota, fit.devices, decision):
                decision.feasible.append((name, fit.devices, node.score))
            if decision.quota is not None and ask.fixed_charge:
                break
        if not decision.feasible:
            _explain(model, ask, names, now, decision, locks, explained)
        return decision
    for name in _in_policy_order(model, names, binpack=ask.node_policy == "binpack"):
        node = get(name)
        if node is None or not passes(node):
            continue
        fit = fit_pod(node, ask)
        decision.fitted += 1
        if fit.devices is not None:
            if not _refused(quota, fit.devices, decision):
                decision.node, decision.devices = name, fit.devices
                return decision
            if ask.fixed_charge:
                break
    _explain(model, ask, names, now, decision, locks, explained)
    return decision


def _summary_check(ask: PodAsk, now: float, locks: LockRule | None) -> Callable[[NodeState], bool]:
    """The cheap check a node passes before it is fitted: enough GPUs with a free slot, enough
    memory and enough cores on the freest of them, usable (``NodeState.usable``), a GPU type the
    pod accepts, no lock that would keep the bind waiting. Each O(1) from the node's summary: under
    binpack the fullest nodes come first, and one whose GPUs have slots but no cores left would
    otherwise be fitted, and fail, on every filter."""
    cache: dict[tuple[str, ...], bool] = {}
    max_count, max_mem, max_cores = ask.max_count, ask.max_memory_mib, ask.max_cores
    typed = bool(ask.prefs.use_types or ask.prefs.nouse_types)
    idle_count = max_count if ask.gpu_rule.mutex else 0

    def passes(node: NodeState) -> bool:
        return not (
            node.free_slot_gpus < max_count
            or node.idle_gpus < idle_count
            or node.max_free_mem < max_mem
            or node.max_free_cores < max_cores
            or not node.registered
            or node.problem is not None
            or node.bad_pods
            or (node.requesting_since is not None and node.dead(now))
            or (typed and not _types_ok(ask, node.type_key, cache))
            or (node.lock is not None and locks is not None and locks.blocks(node, now))
        )

    return passes


def _in_policy_order(model: ClusterModel, names: list[NodeName], *, binpack: bool) -> Iterator[NodeName]:
    """``names`` (each once) fullest node first (``binpack``) or emptiest first, ties by name."""
    wanted = set(names)
    if len(wanted) * _WALK_SHARE >= len(model.order):
        return filter(wanted.__contains__, model.order.names(binpack=binpack))
    get = model.nodes.get
    keyed = [
        (-node.score if binpack else node.score, name) for name in wanted if (node := get(name)) is not None
    ]
    keyed.sort()
    return (name for _, name in keyed)


def _explain(
    model: ClusterModel,
    ask: PodAsk,
    names: Iterable[NodeName],
    now: float,
    decision: Decision,
    locks: LockRule | None,
    explained: Explanations | None,
) -> None:
    if decision.quota is not None:
        # A fit its quota refused: the quota is what keeps the pod out, whatever else each node lacks.
        refused = NodeReasons.of_node(QUOTA_EXCEEDED, decision.quota)
        decision.failed.update(dict.fromkeys(names, refused))
        return
    known = explained.of(ask, nodes=len(model.nodes)) if explained is not None else {}
    ever: dict[tuple[Any, ...], bool] = {}
    for name in names:
        node = model.nodes.get(name)
        if node is None or not node.registered:
            decision.unresolvable[name] = NodeReasons.of_node(NODE_UNREGISTERED)
        elif node.problem is not None:
            decision.unresolvable[name] = NodeReasons.of_node(NODE_REGISTER_MALFORMED)
        elif node.bad_pods:
            decision.failed[name] = NodeReasons.of_node(NODE_ALLOCATION_UNKNOWN)
        elif node.dead(now):
            decision.failed[name] = NodeReasons.of_node(NODE_HANDSHAKE_TIMEOUT)
        elif node.lock is not None and locks is not None and locks.blocks(node, now):
            lock = node.lock
            held = f"{lock.namespace}/{lock.name} since {lock.time.isoformat()}"
            decision.failed[name] = NodeReasons.of_node(NODE_LOCK_HELD, f"node lock held by {held}")
        else:
            entry = known.get(name)
            if entry is None or entry.state is not node or entry.version != node.version:
                entry = known[name] = _explained(node, ask, ever)
            if entry.reasons is None:
                continue  # fits after all (only possible when asked twice); not a failure
            (decision.failed if entry.possible else decision.unresolvable)[name] = entry.reasons


def _explained(node: NodeState, ask: PodAsk, ever: dict[tuple[Any, ...], bool]) -> Explained:
    """Why ``node`` does not fit ``ask`` now, and whether it could if it were empty. Whether a node
    could ever fit depends only on its GPUs' shape (not their UUIDs, unless the pod names UUIDs)
    and on whether its pair scores are readable: one empty fit per shape (``ever``), not per node."""
    fit: Fit = fit_pod(node, ask)
    if fit.ok:
        return Explained(node, node.version, None, True)
    by_uuid = bool(ask.prefs.use_uuids or ask.prefs.nouse_uuids)
    shape = (
        node.scores_problem is not None,
        *(
            (
                g.uuid if by_uuid else "",
                g.count,
                g.devmem,
                g.devcore,
                g.type,
                g.mode,
                g.numa,
                g.health,
                g.cordoned,
                g.refused,
            )
            for g in node.gpus
        ),
    )
    possible = ever.get(shape)
    if possible is None:
        possible = ever[shape] = fit_pod(node, ask, empty=True).ok
    return Explained(node, node.version, fit.why(), possible)


@dataclasses.dataclass(frozen=True, slots=True)
class FailureSummary:
    """Why no node fits, across nodes: each cause with the nodes that failed that way, the cause
    that failed most nodes first (ties by name)."""

    by_cause: tuple[tuple[str, tuple[str, ...]], ...]

    def top_cause(self) -> str:
        """The cause that failed most nodes (``NoNodes`` when none was explained): a metric label."""
        return self.by_cause[0][0] if self.by_cause else "NoNodes"

    def text(self, *, limit: int = 5) -> str:
        """As HAMi's FilteringFailed events word it:
        ``3 nodes CardInsufficientMemory(n1,n2,n3); 1 nodes NodeUnregistered(n4)``."""
        parts = []
        for cause, nodes in self.by_cause:
            shown = ",".join(nodes[:limit]) + (",..." if len(nodes) > limit else "")
            parts.append(f"{len(nodes)} nodes {cause}({shown})")
        return "; ".join(parts)


def summarize(
    failed: Mapping[NodeName, NodeReasons], unresolvable: Mapping[NodeName, NodeReasons]
) -> FailureSummary:
    """Every node's reasons counted per cause."""
    by_cause: dict[str, list[str]] = defaultdict(list)
    for name, reasons in (*failed.items(), *unresolvable.items()):
        for cause, _ in reasons.causes:
            by_cause[cause].append(name)
    ranked = sorted(by_cause.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return FailureSummary(tuple((cause, tuple(sorted(nodes))) for cause, nodes in ranked))
