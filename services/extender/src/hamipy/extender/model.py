"""The extender's in-memory cluster model: nodes, their GPUs and what is allocated on each GPU.

Pure: it is fed raw Node and Pod JSON (watch events, list results) and filter/bind decisions, and
answers from memory; nothing here does I/O. Every change is incremental: a pod event touches only
that pod's contribution, a node event only that node.

Usage on a GPU is the sum of *contributions*, one per pod UID, each either

- ``allocated``: the ``hami.io/vgpu-devices-allocated`` annotation of a *bound* pod (``spec.nodeName``
  set; phase not Succeeded/Failed), on that node, until the pod is gone or finished: a pod being
  deleted holds its GPUs until the kubelet reports its containers stopped (the terminal phase it
  writes before the final delete), since they run through the grace period;
- ``binding``: a bind of this extender in flight (decided, being written), from ``begin_bind`` until
  ``allocate`` (after the Binding), ``release`` (refused), or ``hold_in_doubt`` (no answer: a
  reservation then); or
- ``reserved``: a filter decision not yet visible in the pod, dropped after a time-to-live.

A reservation from ``hold_in_doubt`` (``Contribution.in_doubt``) stands for a Binding that may have
bound the pod: until the pod's watch event or a read of the pod says (``clear_doubt``, or
``release`` of whatever the pod holds), only its time-to-live drops it. A filter of the pod or a
failed bind, which drop the pod's own reservation, leave it: in an API stall the watch may not
report the pod bound for longer than kube-scheduler takes to filter it again.

A pod that is not bound holds nothing, whatever its annotations say: anyone who may create pods can
write ``hami.io/vgpu-node`` and ``vgpu-devices-allocated``, and only a bound pod is ever served GPUs
by the device plugin. So an unbound pod's events never add, change or drop a contribution: our own
bind's record (``binding``, then ``allocated``) survives the pod's watch events before its Binding, a
filter's reservation stays until its TTL, and the pod's Binding event makes it an ordinary
allocation. Another scheduler's pod mid-bind (HAMi's patches it before binding it) is not counted here:
binds on a node serialize on the node lock and each re-checks fresh API state under it
(``binding.Binder``), where the same rule applies; under the lock no other bind is half-written.

An allocation counts init containers by their peak and regular containers summed
(``pod_usage``), as the device plugin serves them: init containers run one after the other and
finish before the others start.

A well-formed register may still name a GPU that is not offered (``Gpu.refused``): one whose UUID an
older node registers, or with 0 MiB (``hamipy.extender.gpu_claims``); each is returned as a refused
``Problem`` for the caller to log and report as an Event.

A dynamic MIG GPU (``Gpu.mig_profiles``) also keeps the placements of the MIG instances its pods
hold or are reserved (``Gpu.mig_taken``), from each contribution's ``mig``: for a bound pod its
``hami.io/vgpu-mig-allocations``, for a decision of ours what the bind writes or, for a filter's
reservation, the plan of its devices on the node as it is (``mig_plan``). They come and go with the
contribution, so a restarted extender has them back from the pods' annotations. A malformed
``hami.io/vgpu-mig-allocations`` on a bound pod is a malformed allocation (below).

A node's ``hami.io/node-nvidia-score`` (``NodeState.pair_scores``) is read when its register is; a
GPU or pair missing from it scores 0, as upstream.

Malformed input is never read as zero: a malformed register annotation makes the node offer nothing
(``NodeState.problem``); a malformed pair-score annotation makes it offer nothing to topology-aware
pods (``NodeState.scores_problem``: the scores are unknown) and its GPUs to every other pod; a
malformed allocation on a bound pod makes its node offer nothing until the pod is gone
(``NodeState.bad_pods``), since what it holds is unknown. A malformed allocation on an
unbound pod holds nothing and blocks nothing. Each is returned as a ``Problem`` for the caller to
log, count and report as an Event.

For preemption (``hamipy.extender.preemption``) it keeps, per bound pod, what choosing victims
reads (``PodFacts``: priority, labels, whether it is leaving already), and the preemptions under
way (``nominations``: the pod, its node and GPUs, the victims it waits for).

The model also keeps the pods that are not bound yet (``pending``: identity, ``schedulerName`` and
the fields a filter reads), so that a filter reserves only for a pod that exists and reads its asks
from the watched object rather than from the caller's copy, and a bind decides without reading the
pod again (its ``resourceVersion`` guards the Binding).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, Literal

from hamipy.extender.disruption_budgets import DisruptionBudgets
from hamipy.extender.gpu_claims import ZERO_MEMORY, ClaimChange, GpuClaims, refusal_text
from hamipy.extender.mig_placement import MigGpu, by_size, plan_allocations, still_taken
from hamipy.extender.node_order import NodeOrder
from hamipy.extender.quota import Quotas
from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice, DeviceInfo, MigPlacement, MigProfile, PodDevices
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.identifiers import GpuUuid, NodeName, PodUid
from hamipy.protocol.mig_allocations import MigAllocation, decode_mig_allocations
from hamipy.protocol.node_devices import decode_node_devices
from hamipy.protocol.node_handshake import HANDSHAKE_TIMEOUT, parse_handshake, reported_by_us
from hamipy.protocol.node_lock import NodeLock, parse_node_lock
from hamipy.protocol.node_scores import NodeScores, decode_node_scores
from hamipy.protocol.pod_devices import decode_pod_devices
from hamipy.protocol.quantities import is_json_int, parse_quantity
from hamipy.protocol.resources import ResourceNames, sidecar_positions

__all__ = [
    "ClusterModel",
    "Contribution",
    "EventType",
    "Gpu",
    "NodeName",
    "NodeState",
    "Nomination",
    "PendingPod",
    "PodFacts",
    "PodUid",
    "Problem",
    "Source",
    "Usage",
    "charge_of",
    "mig_gpus",
    "node_from_json",
    "pod_finished",
    "pod_leaving",
    "pod_priority",
    "pod_sidecars",
    "pod_usage",
]

EventType = Literal["ADDED", "MODIFIED", "DELETED"]
Source = Literal["allocated", "binding", "reserved"]
# (slots, memory MiB, cores percent) taken on one GPU.
Usage = tuple[int, int, int]

_FINISHED: Final = frozenset({"Succeeded", "Failed"})
_DEAD_AFTER_S: Final = HANDSHAKE_TIMEOUT.total_seconds()
_LOCK_RESOLUTION_S: Final = 1.0
_NO_NODE: Final = NodeName("")


@dataclasses.dataclass(slots=True)
class Gpu:
    """One physical GPU of a node and what is allocated on it."""

    uuid: GpuUuid
    index: int
    count: int
    devmem: int
    devcore: int
    type: str
    type_upper: str
    numa: int
    mode: str
    health: bool
    cordoned: bool = False
    used_slots: int = 0
    used_mem: int = 0
    used_cores: int = 0
    node: NodeName = _NO_NODE
    refused: str | None = None
    """Why the node's entry for this GPU is never offered (``gpu_claims``: ``DUPLICATE_UUID``,
    ``ZERO_MEMORY``), None when it may be."""
    owner: Gpu | None = None
    """For a refused duplicate, the entry that owns its UUID (on an older node): this GPU's pods
    count there too."""
    mig_profiles: tuple[MigProfile, ...] = ()
    """A dynamic MIG GPU's profiles (``mode`` mig with profiles registered), smallest first
    (``mig_placement.by_size``); empty on any other GPU, a pre-made MIG instance included."""
    mig_taken: list[MigPlacement] = dataclasses.field(default_factory=list)
    """The placements of the MIG instances its pods hold or are reserved, one per device."""

    @classmethod
    def of(cls, dev: DeviceInfo, *, cordoned: bool = False, node: NodeName = _NO_NODE) -> Gpu:
        return cls(
            mig_profiles=by_size(dev.mig_profiles) if dev.mode == "mig" else (),
            node=node,
            refused=ZERO_MEMORY if dev.devmem <= 0 else None,
            uuid=GpuUuid(dev.id),
            index=dev.index,
            count=dev.count,
            devmem=dev.devmem,
            devcore=dev.devcore,
            type=dev.type,
            type_upper=dev.type.upper(),
            numa=dev.numa,
            mode=dev.mode,
            health=dev.health,
            cordoned=cordoned,
        )


@dataclasses.dataclass(slots=True)
class NodeState:
    """One node as the scheduler sees it. ``gpus`` are ordered by NVML index.

    The summary fields (``score``, ``free_slot_gpus``, ``max_free_mem``, ``max_free_cores``,
    ``type_key``) are kept current by the model so that a filter can rank and skip nodes without
    looking at their GPUs.
    """

    name: NodeName
    uid: str = ""
    created: str = ""
    """``metadata.creationTimestamp``: the oldest node registering a GPU UUID owns it (``gpu_claims``)."""
    gpus: list[Gpu] = dataclasses.field(default_factory=list)
    by_uuid: dict[GpuUuid, Gpu] = dataclasses.field(default_factory=dict)
    registered: bool = False
    problem: str | None = None
    """Why the node offers nothing although it registered (malformed register annotation)."""
    bad_pods: set[PodUid] = dataclasses.field(default_factory=set)
    """Pods on this node whose allocation annotation is malformed: the node offers nothing."""
    allocatable_gpus: int = 0
    requesting_since: float | None = None
    """Epoch seconds of a pending ``Requesting_`` handshake, None when none is pending."""
    handshake: str | None = None
    register_value: str | None = None
    scores_value: str | None = None
    pair_scores: NodeScores = dataclasses.field(default_factory=dict)
    """``hami.io/node-nvidia-score`` decoded: per GPU UUID the score to each other GPU."""
    scores_problem: str | None = None
    """Why ``scores_value`` could not be read (topology-aware pods are not placed here), or None."""
    cordon_value: str | None = None
    lock_value: str | None = None
    lock: NodeLock | None = None
    """``lock_value`` parsed; None when there is no lock or it is malformed (a bind breaks that)."""
    ours: bool = False
    """Served by our device plugin: its last ``Reported_`` handshake carries our marker
    (``keys.DEVICE_PLUGIN_MARKER``). Kept while the handshake is a ``Requesting_`` stamp."""
    score: float = 0.0
    free_slot_gpus: int = 0
    idle_gpus: int = 0
    """Offered GPUs nothing is allocated on (what a ``mutex`` pod may take)."""
    max_free_mem: int = 0
    max_free_cores: int = 0
    """The most cores left on one usable GPU with a free slot (as ``max_free_mem`` for memory)."""
    type_key: tuple[str, ...] = ()
    has_mig: bool = False
    """Whether a GPU of it is a dynamic MIG GPU (``Gpu.mig_profiles``)."""
    version: int = 0
    """Bumped whenever the GPUs' usage changes (``ClusterModel._summarize``): with the object's
    identity (re-registered GPUs make a new one), it says whether a fit could differ from before."""

    def usable(self, now: float) -> bool:
        """Registered, decodable, alive (handshake rule) and holding no malformed allocation."""
        return self.registered and self.problem is None and not self.bad_pods and not self.dead(now)

    def lock_blocks(self, now: float, *, after_s: float, expiry_s: float, pod: tuple[str, str]) -> bool:
        """Whether the node's lock keeps ``pod``'s bind waiting for nothing: another pod has held
        it for more than ``after_s`` (a bind's whole wait) and it has not expired (a bind breaks an
        expired lock). The extender's lock sweep frees such a lock once its owner is gone or served."""
        lock = self.lock
        if lock is None or (lock.namespace, lock.name) == pod:
            return False
        return lock_held_too_long(lock, now, after_s=after_s, expiry_s=expiry_s)

    def dead(self, now: float) -> bool:
        """Upstream's liveness rule: a Requesting_ stamp unanswered for 60 s, no GPU allocatable."""
        since = self.requesting_since
        return since is not None and self.allocatable_gpus <= 0 and now >= since + _DEAD_AFTER_S

    def refresh_summary(self) -> None:
        slots = cores = mem = 0
        total_slots = total_cores = total_mem = 0
        free_slot_gpus = idle_gpus = 0
        max_free_mem = max_free_cores = 0
        for gpu in self.gpus:
            slots += gpu.used_slots
            cores += gpu.used_cores
            mem += gpu.used_mem
            total_slots += gpu.count
            total_cores += gpu.devcore
            total_mem += gpu.devmem
            if gpu.health and not gpu.cordoned and gpu.refused is None and gpu.used_slots < gpu.count:
                free_slot_gpus += 1
                idle_gpus += gpu.used_slots == 0
                max_free_mem = max(max_free_mem, gpu.devmem - gpu.used_mem)
                max_free_cores = max(max_free_cores, gpu.devcore - gpu.used_cores)
        # HAMi's node score (policy.NodeScore.ComputeScore): usage ratios before placement.
        self.score = (
            (slots / total_slots if total_slots else 0.0)
            + (cores / total_cores if total_cores else 0.0)
            + (mem / total_mem if total_mem else 0.0)
        )
        self.free_slot_gpus = free_slot_gpus
        self.idle_gpus = idle_gpus
        self.max_free_mem = max_free_mem
        self.max_free_cores = max_free_cores


@dataclasses.dataclass(frozen=True, slots=True)
class Contribution:
    """What one pod takes on one node: its device list and the per-GPU usage derived from it."""

    uid: PodUid
    namespace: str
    name: str
    node: NodeName
    devices: PodDevices
    n_init: int
    usage: Mapping[GpuUuid, Usage]
    source: Source
    expires_at: float | None = None
    raw: str | None = None
    """The annotation an allocation was decoded from (to skip unchanged pods)."""
    sidecars: frozenset[int] = frozenset()
    """Init slots that are native sidecars (``pod_usage``)."""
    in_doubt: bool = False
    """A reservation held for a Binding whose answer was lost (``hold_in_doubt``): the pod may be
    bound through it."""
    mig: tuple[MigAllocation, ...] = ()
    """The MIG instance of each device on a dynamic MIG GPU (``Gpu.mig_taken``)."""
    mig_raw: str | None = None
    """The ``hami.io/vgpu-mig-allocations`` an allocation's ``mig`` was decoded from."""


@dataclasses.dataclass(frozen=True, slots=True)
class PodFacts:
    """What choosing preemption victims reads of a bound pod."""

    priority: int
    labels: Mapping[str, str]
    leaving: bool
    """Being deleted or finished: it frees its GPUs by itself, and is never chosen again."""
    grace_s: int
    """``terminationGracePeriodSeconds`` (30 when unset): how long its containers may run on."""


@dataclasses.dataclass(frozen=True, slots=True)
class Nomination:
    """A preemption under way: the preemptor's GPUs on ``node`` are held (a reservation) until it is
    bound, deleted, or ``expires_at`` (monotonic) passes; ``victims`` are the pods it waits for."""

    node: NodeName
    devices: PodDevices
    victims: tuple[PodUid, ...]
    expires_at: float


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """A malformed object: ``kind`` Node or Pod, its identity, the annotation and the field in it
    that was wrong, and why; or, ``refused``, a well-formed register entry for a GPU that is not
    offered (``reason`` says why: ``gpu_claims``)."""

    kind: Literal["Node", "Pod"]
    name: str
    namespace: str
    uid: str
    annotation: str
    field: str
    reason: str
    refused: bool = False


def pod_usage(
    devices: Sequence[Sequence[ContainerDevice]], n_init: int, sidecars: frozenset[int] = frozenset()
) -> dict[GpuUuid, Usage]:
    """Per-GPU usage of a device list, as Kubernetes counts a pod's effective requests (KEP-753),
    per dimension: the larger of what the app containers hold together with every native sidecar
    (``sidecars``: positions among the ``n_init`` init containers), and the peak of each regular init
    container together with the sidecars started before it. Without sidecars this is HAMi's
    ``applyPeakUsage``: init containers by their peak, regular ones summed."""
    running: dict[str, list[int]] = {}  # the sidecars started so far
    peak: dict[str, list[int]] = {}
    for i, slot in enumerate(devices):
        if i < n_init and i not in sidecars:
            for uuid, own in _summed(slot).items():
                base = running.get(uuid, _ZERO)
                top = peak.setdefault(uuid, [0, 0, 0])
                for k in range(3):
                    top[k] = max(top[k], base[k] + own[k])
            continue
        for uuid, own in _summed(slot).items():  # a sidecar or an app container: held to the end
            acc = running.setdefault(uuid, [0, 0, 0])
            for k in range(3):
                acc[k] += own[k]
    usage: dict[GpuUuid, Usage] = {}
    for uuid in peak.keys() | running.keys():
        a, b = peak.get(uuid, _ZERO), running.get(uuid, _ZERO)
        usage[GpuUuid(uuid)] = (max(a[0], b[0]), max(a[1], b[1]), max(a[2], b[2]))
    return usage


_ZERO: Final = (0, 0, 0)


def charge_of(usage: Mapping[GpuUuid, Usage]) -> tuple[int, int]:
    """What a pod's usage counts against its namespace's quota: (MiB, cores) summed over its GPUs,
    so a container with two GPUs of 4096 MiB is charged 8192 MiB (``hamipy.extender.quota``)."""
    mem = cores = 0
    for _, m, c in usage.values():
        mem += m
        cores += c
    return mem, cores


def _summed(slot: Sequence[ContainerDevice]) -> dict[str, list[int]]:
    """One container's (slots, MiB, cores) per GPU."""
    per: dict[str, list[int]] = {}
    for dev in slot:
        acc = per.setdefault(dev.uuid, [0, 0, 0])
        acc[0] += 1
        acc[1] += dev.usedmem
        acc[2] += dev.usedcores
    return per


def pod_finished(pod: Mapping[str, Any]) -> bool:
    """Succeeded or Failed: its containers have stopped and its GPUs are free again. A deletion
    timestamp alone is not enough: the containers run (and hold GPU memory) through the grace
    period, and the kubelet moves the pod to a terminal phase once they have stopped, before it
    deletes the object (HAMi counts such pods the same way)."""
    status = pod.get("status") or {}
    return status.get("phase") in _FINISHED


def pod_leaving(pod: Mapping[str, Any]) -> bool:
    """Finished or being deleted: it will never be served (again), though it may still hold GPUs."""
    return bool((pod.get("metadata") or {}).get("deletionTimestamp")) or pod_finished(pod)


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def lock_held_too_long(lock: NodeLock, now: float, *, after_s: float, expiry_s: float) -> bool:
    """Whether ``lock`` (at epoch ``now``) has been held longer than ``after_s`` and not expired.
    A lock's time has whole seconds, so a second more is allowed before it counts."""
    held = now - lock.time.timestamp()
    return after_s + _LOCK_RESOLUTION_S < held <= expiry_s


def _cordoned(value: str | None) -> frozenset[str]:
    # TODO(hamipy.protocol): no codec for hami.io/device-cordon yet; it is a plain comma list.
    if not value:
        return frozenset()
    return frozenset(item.strip() for item in value.split(",") if item.strip())


def _read_liveness(state: NodeState, node: Mapping[str, Any], count_resource: str) -> None:
    """Lock, allocatable GPU count and handshake: the fields that change without the GPUs."""
    ann = _annotations(node)
    lock = ann.get(keys.NODE_LOCK)
    value = lock if isinstance(lock, str) else None
    if value != state.lock_value:
        state.lock_value = value
        try:
            state.lock = parse_node_lock(value) if value else None
        except ProtocolError:
            state.lock = None
    state.allocatable_gpus = 0
    alloc = ((node.get("status") or {}).get("allocatable") or {}).get(count_resource)
    if alloc is not None:
        try:
            state.allocatable_gpus = parse_quantity(alloc, resource=count_resource)
        except ProtocolError:
            state.allocatable_gpus = 0
    handshake = ann.get(keys.NODE_HANDSHAKE)
    state.handshake = handshake if isinstance(handshake, str) else None
    ours = reported_by_us(ann)  # whoever reported last serves the node
    if ours is not None:
        state.ours = ours
    state.requesting_since = None
    if state.handshake:
        try:
            parsed = parse_handshake(state.handshake)
        except ProtocolError:
            # Upstream reads an unparsable stamp as healthy; so do we (the plugin rewrites it).
            return
        if parsed.kind == "Requesting":
            state.requesting_since = parsed.time.timestamp()


def node_from_json(
    node: Mapping[str, Any],
    *,
    count_resource: str = keys.RESOURCE_COUNT,
    previous: NodeState | None = None,
) -> tuple[NodeState, Problem | None]:
    """A fresh ``NodeState`` (no usage yet) from a Node object, and the problem with it if any;
    ``previous``, the node's state before this event, supplies what only a past event told."""
    meta = node.get("metadata") or {}
    name = NodeName(str(meta.get("name", "")))
    ann = _annotations(node)
    state = NodeState(
        name=name,
        uid=str(meta.get("uid", "")),
        created=str(meta.get("creationTimestamp") or ""),
        ours=previous.ours if previous is not None else False,
    )
    problem: Problem | None = None
    register = ann.get(keys.NODE_REGISTER)
    state.register_value = register if isinstance(register, str) else None
    state.cordon_value = ann.get(keys.DEVICE_CORDON)
    _read_liveness(state, node, count_resource)
    if state.register_value is not None:
        state.registered = True
        try:
            devices = decode_node_devices(state.register_value)
        except ProtocolError as exc:
            state.problem = f"malformed {keys.NODE_REGISTER}: {exc}"
            problem = Problem(
                "Node", name, "", str(meta.get("uid", "")), keys.NODE_REGISTER, exc.field, str(exc)
            )
        else:
            cordon = _cordoned(state.cordon_value)
            state.gpus = sorted(
                (Gpu.of(d, cordoned=d.id in cordon, node=name) for d in devices), key=lambda g: g.index
            )
            state.by_uuid = {g.uuid: g for g in state.gpus}
            state.has_mig = any(g.mig_profiles for g in state.gpus)
            state.type_key = tuple(sorted({g.type_upper for g in state.gpus}))
            problem = _read_scores(state, ann.get(keys.NODE_SCORE), uid=str(meta.get("uid", "")))
    state.refresh_summary()
    return state, problem


def _read_scores(state: NodeState, value: Any, *, uid: str) -> Problem | None:
    if value is None:
        return None
    state.scores_value = value if isinstance(value, str) else None
    try:
        if state.scores_value is None:
            raise ProtocolError(f"node {state.name}: {keys.NODE_SCORE}", value, "expected a string")
        state.pair_scores = decode_node_scores(state.scores_value, node=state.name)
    except ProtocolError as exc:
        state.scores_problem = f"malformed {keys.NODE_SCORE}: {exc}"
        return Problem("Node", state.name, "", uid, keys.NODE_SCORE, exc.field, str(exc))
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class PendingPod:
    """A pod the watch has seen not bound and not finished: who it is, which scheduler it asked
    for, and ``pod``, the fields of the watched object a filter or bind reads (metadata with the
    ``resourceVersion``, ``schedulerName`` and containers)."""

    namespace: str
    name: str
    scheduler_name: str
    pod: Mapping[str, Any]
    derived: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Values computed from ``pod`` by other modules, kept as long as this version of the pod
    (``hamipy.extender.filtering.ask_of``): a watch event makes a new ``PendingPod``."""


@dataclasses.dataclass(slots=True)
class _PodInfo:
    uid: PodUid
    namespace: str
    name: str
    node: NodeName | None
    """``spec.nodeName``: None while the pod is not bound."""
    allocated: str | None
    mig_raw: str | None
    n_init: int
    sidecars: frozenset[int]
    finished: bool
    facts: PodFacts


def _pod_info(pod: Mapping[str, Any]) -> _PodInfo:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    ann = meta.get("annotations") or {}
    node = spec.get("nodeName") or None
    allocated = ann.get(keys.DEVICES_ALLOCATED)
    mig = ann.get(keys.MIG_ALLOCATIONS)
    return _PodInfo(
        mig_raw=mig if isinstance(mig, str) and mig else None,
        uid=PodUid(str(meta.get("uid", ""))),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        node=NodeName(str(node)) if node else None,
        allocated=allocated if isinstance(allocated, str) and allocated else None,
        n_init=len(spec.get("initContainers") or []),
        sidecars=pod_sidecars(pod),
        finished=pod_finished(pod),
        facts=PodFacts(
            priority=pod_priority(pod),
            labels=meta.get("labels") or {},
            leaving=pod_leaving(pod),
            grace_s=_int(spec.get("terminationGracePeriodSeconds"), 30),
        ),
    )


def pod_priority(pod: Mapping[str, Any]) -> int:
    """``spec.priority`` (set by the API server from the pod's PriorityClass); 0 when unset."""
    return _int((pod.get("spec") or {}).get("priority"), 0)


def _int(value: Any, default: int) -> int:
    """An integer field of a stored object (bools are not integers here)."""
    return value if is_json_int(value) else default


def pod_sidecars(pod: Mapping[str, Any]) -> frozenset[int]:
    """``sidecar_positions`` of a pod the API server stored (its spec is well formed)."""
    try:
        return sidecar_positions(pod)
    except ProtocolError:  # a spec the API server would not have stored: no sidecars counted
        return frozenset()


_KEPT_META: Final = ("name", "namespace", "uid", "resourceVersion", "annotations")
_KEPT_SPEC: Final = ("schedulerName", "initContainers", "containers", "priority", "preemptionPolicy")


def _pending(info: _PodInfo, pod: Mapping[str, Any]) -> PendingPod:
    # Only what a filter reads (the asks, the preferences in annotations, the identity): the rest of
    # a pending pod (status, managedFields) is not kept alive.
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    kept_spec = {k: spec[k] for k in _KEPT_SPEC if k in spec}
    kept_meta = {k: meta[k] for k in _KEPT_META if k in meta}
    return PendingPod(
        namespace=info.namespace,
        name=info.name,
        scheduler_name=str(spec.get("schedulerName") or ""),
        pod={"metadata": kept_meta, "spec": kept_spec},
    )


class ClusterModel:
    """Nodes and contributions, updated incrementally; see the module docstring."""

    def __init__(
        self, *, count_resource: str = keys.RESOURCE_COUNT, names: ResourceNames | None = None
    ) -> None:
        self.count_resource = count_resource
        self.quotas = Quotas(names or ResourceNames(count=count_resource))
        """The namespaces' GPU quotas (from the ResourceQuota watch), charged ``namespace_usage``."""
        self.nodes: dict[NodeName, NodeState] = {}
        self.claims = GpuClaims()
        """Which node each GPU UUID counts on when several register it (``gpu_claims``)."""
        self.order = NodeOrder()
        """``nodes`` in binpack and in spread order (``hamipy.extender.node_order``): written only here."""
        self.contributions: dict[PodUid, Contribution] = {}
        self.namespace_usage: dict[str, list[int]] = {}
        """Per namespace, [MiB, cores] summed over its pods' contributions (reserved, binding and
        allocated alike): what its ResourceQuotas are charged (``hamipy.extender.quota``)."""
        self.held: dict[Source, int] = {"allocated": 0, "binding": 0, "reserved": 0}
        """How many pods hold GPUs here, by ``Contribution.source`` (a metric: a reservation or a
        bind that never ends shows as a count that does not return to 0)."""
        self._by_node: dict[NodeName, set[PodUid]] = {}
        self._expiry: list[tuple[float, PodUid]] = []
        # Pods seen with a malformed allocation: uid -> node, so the node recovers when they go.
        self._bad: dict[PodUid, NodeName] = {}
        self.pending: dict[PodUid, PendingPod] = {}
        """Pods seen not bound and not finished (``PendingPod``)."""
        self.facts: dict[PodUid, PodFacts] = {}
        """Bound pods not finished that carry an allocation: what choosing preemption victims
        reads of them (other pods hold no GPU, so none is kept for them)."""
        self.budgets = DisruptionBudgets()
        """The PodDisruptionBudgets (from their watch), which preemption respects."""
        self.nominations: dict[PodUid, Nomination] = {}
        """Preemptions under way, by preemptor (``Nomination``)."""
        self.nodes_synced = False
        self.pods_synced = False
        self.generation = 0
        """Bumped on every change (the metrics collector and tests use it)."""
        self.on_freed: Callable[[NodeName | None], None] | None = None
        """Called when capacity may have grown: a pod's GPUs freed on a node, a node registering GPUs
        anew (with that node), or a namespace's GPU limits changed (with None). kube-scheduler does
        not see these through the model: ``hamipy.extender.requeue`` tells it."""

    @property
    def synced(self) -> bool:
        return self.nodes_synced and self.pods_synced

    # -- nodes ----------------------------------------------------------------------------------

    def apply_node(self, event: EventType, node: Mapping[str, Any]) -> list[Problem]:
        """Apply one Node watch event."""
        name = NodeName(str((node.get("metadata") or {}).get("name", "")))
        self.generation += 1
        if event == "DELETED":
            self._drop_node(name)
            return []
        old = self.nodes.get(name)
        ann = _annotations(node)
        if (
            old is not None
            and old.register_value == ann.get(keys.NODE_REGISTER)
            and old.cordon_value == ann.get(keys.DEVICE_CORDON)
            and old.scores_value == ann.get(keys.NODE_SCORE)
            and old.created == str((node.get("metadata") or {}).get("creationTimestamp") or "")
        ):
            # Only liveness/lock fields changed: keep the GPUs and their usage.
            _read_liveness(old, node, self.count_resource)
            return []
        state, problem = node_from_json(node, count_resource=self.count_resource, previous=old)
        if old is not None:
            state.bad_pods = old.bad_pods
        self.nodes[name] = state
        self._recount(state)
        change = self.claims.replace(old, state)
        self._claims_changed(change, skip=name)
        self._summarize(state)
        self.freed(name)
        was = old.by_uuid if old is not None else {}
        refused = [
            gpu
            for gpu in state.gpus
            if gpu.refused == ZERO_MEMORY
            and ((before := was.get(gpu.uuid)) is None or before.refused != ZERO_MEMORY)
        ]
        return ([problem] if problem else []) + self._refusals([*refused, *change.refused])

    def _drop_node(self, name: NodeName) -> None:
        """The node is gone: the UUIDs it registered are owned again by the nodes left."""
        old = self.nodes.pop(name, None)
        self.order.drop(name)
        if old is not None:
            self._claims_changed(self.claims.replace(old, None), skip=name)

    def _claims_changed(self, change: ClaimChange, *, skip: NodeName) -> None:
        """Other nodes' GPUs were refused or offered again, or took on usage (``gpu_claims``)."""
        for other in change.nodes - {skip}:
            state = self.nodes.get(other)
            if state is not None:
                self._summarize(state)
        for node in {gpu.node for gpu in change.accepted} - {skip}:
            self.freed(node)

    def _refusals(self, gpus: Iterable[Gpu]) -> list[Problem]:
        """One problem per node with GPUs newly refused, naming every GPU refused there: a node has
        one Event per reason, whose message the latest report replaces."""
        problems = []
        for name in sorted({gpu.node for gpu in gpus}):
            state = self.nodes.get(name)
            if state is None:
                continue
            reason = "; ".join(refusal_text(gpu) for gpu in state.gpus if gpu.refused is not None)
            problems.append(
                Problem(
                    "Node", name, "", state.uid, keys.NODE_REGISTER, keys.NODE_REGISTER, reason, refused=True
                )
            )
        return problems

    def refused_gpus(self, cause: str) -> int:
        """How many GPU entries are refused for ``cause`` (``gpu_claims``): a metric, counted over
        the GPUs at each scrape (a pass over 8,000 GPUs at 1,000 nodes)."""
        return sum(1 for state in self.nodes.values() for gpu in state.gpus if gpu.refused == cause)

    def replace_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> list[Problem]:
        """A full list: apply each, and forget nodes not in it."""
        problems: list[Problem] = []
        seen: set[str] = set()
        for node in nodes:
            seen.add(str((node.get("metadata") or {}).get("name", "")))
            problems += self.apply_node("MODIFIED", node)
        for name in list(self.nodes):
            if name not in seen:
                self._drop_node(name)
        self.nodes_synced = True
        return problems

    def _recount(self, state: NodeState) -> None:
        """``state``'s usage from its pods; before its GPUs are claimed (``claims.replace``)."""
        for gpu in state.gpus:
            gpu.used_slots = gpu.used_mem = gpu.used_cores = 0
            gpu.mig_taken.clear()
        for uid in self._by_node.get(state.name, ()):
            contribution = self.contributions[uid]
            self._add_usage(state, contribution.usage, 1)
            self._add_mig(state, contribution.mig, 1)
        self._summarize(state)

    def _summarize(self, state: NodeState) -> None:
        """After ``state``'s usage or GPUs changed: its summary, its version, its place in ``order``."""
        state.refresh_summary()
        state.version += 1
        self.order.put(state.name, state.score)

    def _add_usage(self, state: NodeState, usage: Mapping[GpuUuid, Usage], sign: int) -> None:
        by_uuid = state.by_uuid
        for uuid, (slots, mem, cores) in usage.items():
            gpu = by_uuid.get(uuid)
            if gpu is None:
                continue  # a GPU the node no longer registers takes nothing from the others
            gpu.used_slots += sign * slots
            gpu.used_mem += sign * mem
            gpu.used_cores += sign * cores
            owner = gpu.owner
            if owner is not None:  # a duplicate of an older node's GPU: the same GPU's pods
                owner.used_slots += sign * slots
                owner.used_mem += sign * mem
                owner.used_cores += sign * cores
                other = self.nodes.get(owner.node)
                if other is not None:
                    self._summarize(other)

    @staticmethod
    def _add_mig(state: NodeState, mig: Sequence[MigAllocation], sign: int) -> None:
        for allocation in mig:
            gpu = state.by_uuid.get(GpuUuid(allocation.gpu_uuid))
            if gpu is None or not gpu.mig_profiles:
                continue  # no longer a dynamic MIG GPU of this node: it holds nothing there
            if sign > 0:
                gpu.mig_taken.append(allocation.placement)
            elif allocation.placement in gpu.mig_taken:
                gpu.mig_taken.remove(allocation.placement)

    def mig_plan(
        self, node: NodeName, devices: PodDevices, *, exclude: PodUid | None = None
    ) -> tuple[MigAllocation, ...] | None:
        """The MIG allocations of ``devices`` on ``node`` as it is now, less what ``exclude`` holds
        (``mig_placement.plan_allocations``): () on a node without dynamic MIG GPUs, None when a
        device finds no room."""
        state = self.nodes.get(node)
        if state is None or not state.has_mig:
            return ()
        return plan_allocations(
            devices, mig_gpus(state, self.contributions.get(exclude) if exclude else None)
        )

    # -- contributions --------------------------------------------------------------------------

    def _set(self, contribution: Contribution | None, uid: PodUid, *, quiet: bool = False) -> None:
        old = self.contributions.pop(uid, None)
        if old is not None:
            self._charge(old, -1)
            self.held[old.source] -= 1
            self._by_node[old.node].discard(uid)
            state = self.nodes.get(old.node)
            if state is not None:
                self._add_usage(state, old.usage, -1)
                self._add_mig(state, old.mig, -1)
                if contribution is None or contribution.node != old.node:
                    self._summarize(state)
            if not quiet and (contribution is None or contribution.node != old.node):
                self.freed(old.node)
        if contribution is not None:
            self.contributions[uid] = contribution
            self._charge(contribution, 1)
            self.held[contribution.source] += 1
            self._by_node.setdefault(contribution.node, set()).add(uid)
            state = self.nodes.get(contribution.node)
            if state is not None:
                self._add_usage(state, contribution.usage, 1)
                self._add_mig(state, contribution.mig, 1)
                self._summarize(state)
            if contribution.expires_at is not None:
                heapq.heappush(self._expiry, (contribution.expires_at, uid))
        self.generation += 1

    def freed(self, node: NodeName | None) -> None:
        """Report that capacity may have grown (on ``node``, or anywhere for None): ``on_freed``."""
        if self.on_freed is not None:
            self.on_freed(node)

    def freed_unless_kept(
        self, held: Contribution, node: NodeName | None, devices: PodDevices | None
    ) -> None:
        """A pod set its reservation ``held`` aside quietly and now takes ``devices`` on ``node``
        (None: nothing): report ``held``'s node freed unless those are the same GPUs."""
        if node != held.node or devices != held.devices:
            self.freed(held.node)

    def quotas_changed(self) -> None:
        """The ResourceQuota feed changed a namespace's GPU limits."""
        self.generation += 1
        self.freed(None)

    def _charge(self, contribution: Contribution, sign: int) -> None:
        mem, cores = charge_of(contribution.usage)
        acc = self.namespace_usage.setdefault(contribution.namespace, [0, 0])
        acc[0] += sign * mem
        acc[1] += sign * cores
        if acc == [0, 0] and sign < 0:
            del self.namespace_usage[contribution.namespace]

    def used_by(self, namespace: str, *, exclude: PodUid | None = None) -> tuple[int, int]:
        """(MiB, cores) the namespace's pods hold or are reserved, less ``exclude``'s own."""
        mem, cores = self.namespace_usage.get(namespace, (0, 0))
        own = self.contributions.get(exclude) if exclude is not None else None
        if own is not None and own.namespace == namespace:
            own_mem, own_cores = charge_of(own.usage)
            mem, cores = mem - own_mem, cores - own_cores
        return mem, cores

    def _set_bad(self, uid: PodUid, node: NodeName | None) -> None:
        old = self._bad.pop(uid, None)
        if old is not None and old in self.nodes:
            self.nodes[old].bad_pods.discard(uid)
        if node is not None:
            self._bad[uid] = node
            state = self.nodes.get(node)
            if state is None:
                state = NodeState(name=node)
                self.nodes[node] = state
                self.order.put(node, state.score)
            state.bad_pods.add(uid)

    def apply_pod(self, event: EventType, pod: Mapping[str, Any]) -> list[Problem]:
        """Apply one Pod watch event."""
        info = _pod_info(pod)
        uid = info.uid
        if event == "DELETED" or info.finished:
            self.pending.pop(uid, None)
            self.facts.pop(uid, None)
            self.nominations.pop(uid, None)
            self._set_bad(uid, None)
            if uid in self.contributions:
                self._set(None, uid)
            return []
        if info.node is None:
            # Not bound: holds nothing and changes no contribution (the module docstring says why).
            self.pending[uid] = _pending(info, pod)
            if info.allocated is not None:
                try:
                    decode_pod_devices(info.allocated, field=keys.DEVICES_ALLOCATED)
                except ProtocolError as exc:
                    return [
                        Problem(
                            "Pod", info.name, info.namespace, uid, keys.DEVICES_ALLOCATED, exc.field, str(exc)
                        )
                    ]
            return []
        self.pending.pop(uid, None)
        self.nominations.pop(uid, None)  # a preemptor bound: its preemption is over
        current = self.contributions.get(uid)
        if info.allocated is None:
            self.facts.pop(uid, None)  # holds no GPU: never a victim, so nothing to keep
            self._set_bad(uid, None)
            if current is not None and current.source == "allocated":
                self._set(None, uid)  # annotations removed
            return []
        self.facts[uid] = info.facts  # it may be a preemption victim
        if (
            current is not None
            and current.source == "allocated"
            and current.node == info.node
            and current.raw == info.allocated
            and current.mig_raw == info.mig_raw
        ):
            return []
        try:
            devices = decode_pod_devices(info.allocated, field=keys.DEVICES_ALLOCATED)
            mig = decode_mig_allocations(info.mig_raw) if info.mig_raw else ()
        except ProtocolError as exc:
            self._set(None, uid)
            self._set_bad(uid, info.node)
            annotation = (
                keys.MIG_ALLOCATIONS if exc.field.startswith(keys.MIG_ALLOCATIONS) else keys.DEVICES_ALLOCATED
            )
            return [Problem("Pod", info.name, info.namespace, uid, annotation, exc.field, str(exc))]
        self._set_bad(uid, None)
        self._set(
            Contribution(
                uid=uid,
                namespace=info.namespace,
                name=info.name,
                node=info.node,
                devices=devices,
                n_init=info.n_init,
                usage=pod_usage(devices, info.n_init, info.sidecars),
                source="allocated",
                expires_at=None,
                raw=info.allocated,
                sidecars=info.sidecars,
                mig=mig,
                mig_raw=info.mig_raw,
            ),
            uid,
        )
        return []

    def replace_pods(self, pods: Iterable[Mapping[str, Any]]) -> list[Problem]:
        """A full list: apply each; allocations of pods not in it are dropped (reservations and binds
        in flight stay)."""
        problems: list[Problem] = []
        seen: set[str] = set()
        self.pending.clear()
        self.facts.clear()
        for pod in pods:
            seen.add(str((pod.get("metadata") or {}).get("uid", "")))
            problems += self.apply_pod("MODIFIED", pod)
        for uid, contribution in list(self.contributions.items()):
            if contribution.source == "allocated" and uid not in seen:
                self._set(None, uid)
        for uid in list(self._bad):
            if uid not in seen:
                self._set_bad(uid, None)
        self.pods_synced = True
        return problems

    def reserve(
        self,
        *,
        uid: PodUid,
        namespace: str,
        name: str,
        node: NodeName,
        devices: PodDevices,
        n_init: int,
        expires_at: float,
        sidecars: frozenset[int] = frozenset(),
    ) -> None:
        """Record a decision at once, so the next filter sees it; replaces the pod's previous one.
        Its MIG instances are planned on the node as it is, less the pod's previous decision."""
        mig = self.mig_plan(node, devices, exclude=uid) or ()
        self._set(
            Contribution(
                uid=uid,
                namespace=namespace,
                name=name,
                node=node,
                devices=devices,
                n_init=n_init,
                usage=pod_usage(devices, n_init, sidecars),
                source="reserved",
                expires_at=expires_at,
                sidecars=sidecars,
                mig=mig,
            ),
            uid,
        )

    def begin_bind(
        self,
        *,
        uid: PodUid,
        namespace: str,
        name: str,
        node: NodeName,
        devices: PodDevices,
        n_init: int,
        raw: str,
        sidecars: frozenset[int] = frozenset(),
        mig: tuple[MigAllocation, ...] = (),
        mig_raw: str | None = None,
    ) -> None:
        """Record a bind of ours about to write ``raw`` and ``mig_raw`` (source ``binding``): it
        counts while the pod is annotated but not bound, until ``allocate`` or ``release``."""
        self._record(uid, namespace, name, node, devices, n_init, raw, "binding", sidecars, mig, mig_raw)

    def allocate(
        self,
        *,
        uid: PodUid,
        namespace: str,
        name: str,
        node: NodeName,
        devices: PodDevices,
        n_init: int,
        raw: str,
        sidecars: frozenset[int] = frozenset(),
        mig: tuple[MigAllocation, ...] = (),
        mig_raw: str | None = None,
    ) -> None:
        """Record an allocation written and bound by our bind before its watch event arrives (the
        event, carrying the same ``raw`` and ``mig_raw`` annotations, is then a no-op)."""
        self._record(uid, namespace, name, node, devices, n_init, raw, "allocated", sidecars, mig, mig_raw)

    def _record(
        self,
        uid: PodUid,
        namespace: str,
        name: str,
        node: NodeName,
        devices: PodDevices,
        n_init: int,
        raw: str,
        source: Source,
        sidecars: frozenset[int],
        mig: tuple[MigAllocation, ...],
        mig_raw: str | None,
    ) -> None:
        self._set(
            Contribution(
                uid=uid,
                namespace=namespace,
                name=name,
                node=node,
                devices=devices,
                n_init=n_init,
                usage=pod_usage(devices, n_init, sidecars),
                source=source,
                raw=raw,
                sidecars=sidecars,
                mig=mig,
                mig_raw=mig_raw,
            ),
            uid,
        )

    def release(self, uid: PodUid, *, source: Source | None = "reserved", quiet: bool = False) -> None:
        """Drop what the pod holds when it is from ``source`` (its reservation unless told; None:
        whatever it holds, as the API has just said). With ``quiet`` nothing is reported ``freed``:
        the caller takes the GPUs again at once (a bind of the reserved pod), and reports ``freed``
        itself when it does not.

        A failed bind drops its own record (``binding``), never an allocation: a pod's allocation
        goes only when the API says so (its watch event, or a read of the pod). A hold in doubt
        stays unless ``source`` is None (``hold_in_doubt``)."""
        current = self.contributions.get(uid)
        if current is None:
            return
        if source is None or (current.source == source and not current.in_doubt):
            self._set(None, uid, quiet=quiet)

    def hold_in_doubt(self, uid: PodUid, *, expires_at: float) -> None:
        """A bind of ours whose Binding may have been written (its answer was lost: a timeout, a
        connection cut): its GPUs stay counted, as a reservation in doubt until ``expires_at``. The
        pod's watch event makes them an allocation if it was bound; the pod's next bind reads the
        pod and settles it (``clear_doubt`` when it is not bound); else the expiry frees them."""
        current = self.contributions.get(uid)
        if current is not None and current.source == "binding":
            held = dataclasses.replace(
                current, source="reserved", expires_at=expires_at, raw=None, in_doubt=True
            )
            self._set(held, uid, quiet=True)

    def in_doubt(self, uid: PodUid) -> bool:
        """Whether the pod's GPUs are held for a Binding whose answer was lost (``hold_in_doubt``)."""
        current = self.contributions.get(uid)
        return current is not None and current.in_doubt

    def clear_doubt(self, uid: PodUid) -> None:
        """A read found the pod of a hold in doubt not bound: the hold is an ordinary reservation
        again, for the bind that read it to take over or drop."""
        current = self.contributions.get(uid)
        if current is not None and current.in_doubt:
            self.contributions[uid] = dataclasses.replace(current, in_doubt=False)  # the same GPUs

    def drop_reservations(self) -> int:
        """Forget every reservation (a replica that stops deciding: they steered only its own
        decisions, and the leader holds its own); binds in flight and allocations stay. Quietly:
        nothing was bound or freed. Returns how many."""
        held = [uid for uid, c in self.contributions.items() if c.source == "reserved"]
        for uid in held:
            self._set(None, uid, quiet=True)
        return len(held)

    def expire(self, now: float) -> int:
        """Drop reservations whose time is up; returns how many."""
        dropped = 0
        heap = self._expiry
        while heap and heap[0][0] <= now:
            at, uid = heapq.heappop(heap)
            current = self.contributions.get(uid)
            if current is not None and current.source == "reserved" and current.expires_at == at:
                self._set(None, uid)
                dropped += 1
        return dropped

    def pods_on(self, node: NodeName) -> list[Contribution]:
        return [self.contributions[uid] for uid in self._by_node.get(node, ())]


def mig_gpus(state: NodeState, exclude: Contribution | None = None) -> dict[str, MigGpu]:
    """``state``'s dynamic MIG GPUs as ``plan_allocations`` takes them: profiles and the
    placements taken, less those of ``exclude``."""
    own = exclude.mig if exclude is not None and exclude.node == state.name else ()
    return {
        gpu.uuid: (gpu.mig_profiles, still_taken(gpu.uuid, gpu.mig_taken, own))
        for gpu in state.gpus
        if gpu.mig_profiles
    }


def now_epoch() -> float:
    """Wall-clock seconds (handshake stamps are wall-clock times)."""
    return datetime.now(UTC).timestamp()
