"""Whether a pod fits a node's GPUs, and on which ones (pure).

The checks are those of docs/wire-format.md#resources and #user-annotations, in HAMi's order
(``pkg/device/nvidia/device.go`` ``Fit``), each failing GPU counted under HAMi's reason name:

=================================  ===========================================================
``CardRefused``                    its register entry is refused (our name): an older node
                                   registers the same UUID, or it has 0 MiB (``gpu_claims``)
``CardNotHealth``                  the GPU registered unhealthy
``CardCordoned``                   the GPU is named in ``hami.io/device-cordon`` (our name)
``CardTypeMismatch``               use/nouse-gputype or vgpu-mode exclude it
``CardUuidMismatch``               use/nouse-gpuuuid exclude it
``CardTimeSlicingExhausted``       every slot (split count) taken
``CardInsufficientMemory``         not enough memory left (MiB or percentage of ``devmem``), or
                                   on a dynamic MIG GPU more than its largest profile has
``CardInsufficientCore``           not enough cores left
``ExclusiveDeviceAllocateConflict``  a ``mutex`` pod, or cores = 100 asked, on a GPU that has a user
``CardComputeUnitsExhausted``      cores = 0 asked on a GPU whose cores are all taken
``CardMigTopologyInfeasible``      a dynamic MIG GPU with the memory, but fragmented: no profile
                                   covering the ask has a placement free of the instances taken
``NumaNotFit``                     numa-bind: no NUMA node has enough fitting GPUs
``AllocatedCardsInsufficientRequest``  some GPUs fit, fewer than the container asks
``NodeInsufficientDevice``         the node has fewer GPUs than one container asks
``NodePairScoresMalformed``        topology-aware: the node's pair scores cannot be read (ours)
=================================  ===========================================================

The GPU policy (``scoring.GpuRule``) orders the GPUs tried; ``mutex`` refuses a GPU with a user
(one-sided, as HAMi's: a later pod without it may still join the GPU a mutex pod holds);
``topology-aware`` takes, among every GPU that fits the container, the best-linked ones
(``hamipy.extender.topology``) rather than the first. With ``numa-bind`` that search runs within
the first NUMA node, in the policy's order, that has enough GPUs fitting.

On a dynamic MIG GPU (``Gpu.mig_profiles``) every check above runs as on any GPU, and then the
ask must find a profile and placement (``hamipy.extender.mig_placement``) beside the instances its
pods hold and those this pod takes before it; the device gets the profile's memory and SM share
(HAMi's ``AddResourceUsage``). Every container's instances are kept apart, init containers' too.
A pre-made MIG instance registers as a GPU of its own (``count`` 1) and needs nothing more.

A pod's init containers are each fitted alone on the node as it is (they run one after the other),
its regular containers one after the other on the node with the previous ones' devices taken, as
HAMi's ``scoreNode`` does; the device list has one slot per container, init containers first.
Native sidecars (init containers with ``restartPolicy: Always``) keep running once started: each is
fitted with the sidecars before it taken, and what they take stays taken for the init containers
after them and for the regular containers (Kubernetes' effective requests; HAMi counts them as
run-to-completion init containers and over-allocates).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Final

from hamipy.extender.mig_placement import select_candidate, still_taken
from hamipy.extender.model import Gpu, NodeState
from hamipy.extender.scoring import GpuRule, Policy, gpu_order
from hamipy.extender.topology import PairScores, pick_gpus
from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice, MigPlacement, PodDevices
from hamipy.protocol.mig_allocations import MigAllocation
from hamipy.protocol.pod_preferences import (
    PodPreferences,
    ScoringWeights,
    mode_allowed,
    type_allowed,
    uuid_allowed,
)
from hamipy.protocol.resources import (
    ContainerRequest,
    PodRequests,
    exclusive_conflict,
    memory_for_device,
    zero_core_conflict,
)

__all__ = [
    "ALLOCATED_INSUFFICIENT",
    "CARD_CORDONED",
    "CARD_MIG_TOPOLOGY_INFEASIBLE",
    "CARD_REFUSED",
    "NODE_INSUFFICIENT_DEVICE",
    "NODE_PAIR_SCORES_MALFORMED",
    "NODE_UNFIT_POD",
    "NUMA_NOT_FIT",
    "Fit",
    "NodeReasons",
    "PodAsk",
    "fit_pod",
]

CARD_REFUSED: Final = "CardRefused"
CARD_NOT_HEALTH: Final = "CardNotHealth"
CARD_CORDONED: Final = "CardCordoned"
CARD_TYPE_MISMATCH: Final = "CardTypeMismatch"
CARD_UUID_MISMATCH: Final = "CardUuidMismatch"
CARD_SLOTS_EXHAUSTED: Final = "CardTimeSlicingExhausted"
CARD_MEMORY: Final = "CardInsufficientMemory"
CARD_CORE: Final = "CardInsufficientCore"
EXCLUSIVE_CONFLICT: Final = "ExclusiveDeviceAllocateConflict"
COMPUTE_EXHAUSTED: Final = "CardComputeUnitsExhausted"
CARD_MIG_TOPOLOGY_INFEASIBLE: Final = "CardMigTopologyInfeasible"
NUMA_NOT_FIT: Final = "NumaNotFit"
ALLOCATED_INSUFFICIENT: Final = "AllocatedCardsInsufficientRequest"
NODE_INSUFFICIENT_DEVICE: Final = "NodeInsufficientDevice"
NODE_UNFIT_POD: Final = "NodeUnfitPod"
NODE_PAIR_SCORES_MALFORMED: Final = "NodePairScoresMalformed"


@dataclasses.dataclass(frozen=True, slots=True)
class PodAsk:
    """Everything a fit needs about a pod, resolved once per filter."""

    requests: PodRequests
    prefs: PodPreferences
    node_policy: Policy
    gpu_rule: GpuRule
    weights: ScoringWeights

    @property
    def slots(self) -> tuple[ContainerRequest | None, ...]:
        return self.requests.slots

    @property
    def n_init(self) -> int:
        return len(self.requests.init)

    @property
    def sidecars(self) -> frozenset[int]:
        return self.requests.sidecars

    @property
    def max_count(self) -> int:
        """The most GPUs one container asks (a node needs at least this many with a free slot)."""
        return max((r.count for r in self.slots if r is not None), default=0)

    @property
    def fixed_charge(self) -> bool:
        """Whether every container asks fixed MiB, so the pod's quota charge is the same on every
        node (a percentage is resolved against the GPU chosen)."""
        return all(r.memory_mib is not None for r in self.slots if r is not None)

    @property
    def max_cores(self) -> int:
        """The most cores one container asks per GPU."""
        return max((r.cores for r in self.slots if r is not None), default=0)

    @property
    def max_memory_mib(self) -> int:
        """The most fixed MiB one container asks per GPU (0 when all ask percentages)."""
        return max((r.memory_mib or 0 for r in self.slots if r is not None), default=0)


@dataclasses.dataclass(frozen=True, slots=True)
class NodeReasons:
    """Why one node does not take a pod, as data: per cause, how many of its ``n_gpus`` GPUs failed
    that way (HAMi's ``GenReason`` counts). A node-level cause (``NodeUnregistered``...) has
    ``n_gpus`` 0, and ``detail`` says more where a cause alone would not (``InvalidRequest``).

    Kept as data from the fit to the edge: the HTTP answer, the Event and the metric label each
    format it once, and nothing parses text back."""

    causes: tuple[tuple[str, int], ...]
    n_gpus: int = 0
    detail: str = ""

    @classmethod
    def of_gpus(cls, counts: Counter[str], n_gpus: int) -> NodeReasons:
        return cls(tuple(sorted(counts.items())), n_gpus)

    @classmethod
    def of_node(cls, cause: str, detail: str = "") -> NodeReasons:
        return cls(((cause, 1),), 0, detail)

    def text(self) -> str:
        """HAMi's wording: ``1/8 CardInsufficientMemory, 7/8 CardTimeSlicingExhausted``; a node-level
        cause alone (``NodeUnregistered``, ``InvalidRequest: <detail>``)."""
        if self.detail and not self.n_gpus:  # may quote a tenant's annotation: never kept
            return ", ".join(f"{cause}: {self.detail}" for cause, _ in self.causes)
        return _reasons_text(self.causes, self.n_gpus)


@functools.lru_cache(maxsize=1024)
def _reasons_text(causes: tuple[tuple[str, int], ...], n_gpus: int) -> str:
    # Memoised: a filter that fits nowhere writes a text per node, and across nodes (and pods)
    # the reasons are mostly the same few (causes are HAMi's fixed names, counts up to the GPUs).
    if not n_gpus:
        return ", ".join(cause for cause, _ in causes)
    return ", ".join(f"{count}/{n_gpus} {cause}" for cause, count in causes)


@dataclasses.dataclass(frozen=True, slots=True)
class Fit:
    """``devices`` when the pod fits (one slot per container), else ``reasons`` (cause -> GPUs)."""

    devices: PodDevices | None
    reasons: Counter[str]
    n_gpus: int

    @property
    def ok(self) -> bool:
        return self.devices is not None

    def why(self) -> NodeReasons:
        """The reasons as data (``NodeUnfitPod`` when a fit failed with none counted)."""
        if not self.reasons:
            return NodeReasons.of_node(NODE_UNFIT_POD)
        return NodeReasons.of_gpus(self.reasons, self.n_gpus)


# Per GPU position, the MIG placements taken on a dynamic MIG GPU during one fit: its pods' and
# those this pod took so far. Only MIG GPUs have an entry.
_MigTaken = dict[int, list[MigPlacement]]


def _check(
    gpu: Gpu,
    used: list[int],
    req: ContainerRequest,
    prefs: PodPreferences,
    *,
    mutex: bool,
    mig: list[MigPlacement] | None = None,
) -> str | None:
    """The reason ``gpu`` cannot take ``req`` now, or None when it can."""
    if gpu.refused is not None:
        return CARD_REFUSED
    if not gpu.health:
        return CARD_NOT_HEALTH
    if gpu.cordoned:
        return CARD_CORDONED
    if not type_allowed(prefs, gpu.type) or not mode_allowed(prefs, gpu.mode):
        return CARD_TYPE_MISMATCH
    if not uuid_allowed(prefs, gpu.uuid):
        return CARD_UUID_MISMATCH
    slots, mem, cores = used
    if slots >= gpu.count:
        return CARD_SLOTS_EXHAUSTED
    if mutex and slots:
        return EXCLUSIVE_CONFLICT
    if gpu.devmem - mem < memory_for_device(req, gpu.devmem):
        return CARD_MEMORY
    if gpu.devcore - cores < req.cores:
        return CARD_CORE
    if exclusive_conflict(req.cores, device_used=slots, device_totalcore=gpu.devcore):
        return EXCLUSIVE_CONFLICT
    if zero_core_conflict(req.cores, device_usedcores=cores, device_totalcore=gpu.devcore):
        return COMPUTE_EXHAUSTED
    if mig is not None:
        asked = memory_for_device(req, gpu.devmem)
        if select_candidate(gpu.mig_profiles, mig, asked) is None:
            # Larger than every profile is a lack of memory; else the GPU is fragmented.
            return CARD_MEMORY if gpu.mig_profiles[-1].memory_mb < asked else CARD_MIG_TOPOLOGY_INFEASIBLE
    return None


def _fit_container(
    gpus: Sequence[Gpu],
    used: list[list[int]],
    req: ContainerRequest,
    ask: PodAsk,
    preferred: Sequence[str],
    reasons: Counter[str],
    scores: PairScores,
    mig: _MigTaken,
) -> list[int] | None:
    """Positions of the GPUs chosen for one container, or None (``reasons`` filled in)."""
    if req.count > len(gpus):
        reasons[NODE_INSUFFICIENT_DEVICE] += 1
        return None
    rule = ask.gpu_rule
    order = gpu_order(gpus, used, req, rule=rule, weights=ask.weights)
    first: list[int] = []
    if preferred:
        position: dict[str, int] = {g.uuid: i for i, g in enumerate(gpus)}
        first = [position[u] for u in preferred if u in position]
        order = first + [i for i in order if i not in first]
    verdicts = {i: _check(gpus[i], used[i], req, ask.prefs, mutex=rule.mutex, mig=mig.get(i)) for i in order}

    def take(fitting: list[int]) -> list[int]:
        if not rule.topology or len(fitting) == req.count:
            return fitting[: req.count]
        if first and fitting[: req.count] == first:
            return first  # an earlier decision that still fits stays
        return [fitting[p] for p in pick_gpus([gpus[i].uuid for i in fitting], req.count, scores)]

    if ask.prefs.numa_bind:
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(gpus[i].numa, []).append(i)
        best = 0
        for members in groups.values():
            fitting = [i for i in members if verdicts[i] is None]
            if len(fitting) >= req.count:
                return take(fitting)
            best = max(best, len(fitting))
        _count(verdicts, reasons)
        if sum(1 for v in verdicts.values() if v is None) >= req.count:
            reasons[NUMA_NOT_FIT] += best
        elif best:
            reasons[ALLOCATED_INSUFFICIENT] += best
        return None
    fitting = [i for i in order if verdicts[i] is None]
    if len(fitting) >= req.count:
        return take(fitting)
    _count(verdicts, reasons)
    if fitting:
        reasons[ALLOCATED_INSUFFICIENT] += len(fitting)
    return None


def _count(verdicts: dict[int, str | None], reasons: Counter[str]) -> None:
    for verdict in verdicts.values():
        if verdict is not None:
            reasons[verdict] += 1


def _take(
    gpus: Sequence[Gpu], used: list[list[int]], chosen: list[int], req: ContainerRequest, mig: _MigTaken
) -> list[ContainerDevice]:
    devices = []
    for i in chosen:
        gpu = gpus[i]
        mem = memory_for_device(req, gpu.devmem)
        cores = req.cores
        taken = mig.get(i)
        if taken is not None:  # a dynamic MIG GPU: the instance's memory and SMs (_check found one)
            candidate = select_candidate(gpu.mig_profiles, taken, mem)
            assert candidate is not None
            profile, placement = candidate
            mem, cores = profile.memory_mb, profile.core
            taken.append(placement)
        used[i][0] += 1
        used[i][1] += mem
        used[i][2] += cores
        devices.append(ContainerDevice(gpu.uuid, keys.DEVICE_VENDOR_NVIDIA, mem, cores))
    return devices


def fit_pod(
    node: NodeState,
    ask: PodAsk,
    *,
    empty: bool = False,
    preferred: PodDevices | None = None,
    held: Sequence[Sequence[int]] | None = None,
    freed: Iterable[MigAllocation] = (),
) -> Fit:
    """Fit every container of the pod on ``node``'s GPUs as they are used now (``empty``: as if
    nothing were allocated, to tell "never fits" from "not now"; ``held``: as if each GPU, in
    ``node.gpus`` order, held these (slots, MiB, cores), and ``freed``'s MIG instances were gone, to
    ask "what if these pods were gone").
    ``preferred`` (an earlier decision) is tried first, GPU by GPU, so a re-check keeps it where it
    still fits."""
    gpus = node.gpus
    if ask.gpu_rule.topology and node.scores_problem is not None:
        return Fit(None, Counter({NODE_PAIR_SCORES_MALFORMED: 1}), len(gpus))
    if held is not None:
        base = [list(u) for u in held]
    else:
        base = [[0, 0, 0] if empty else [g.used_slots, g.used_mem, g.used_cores] for g in gpus]
    # A MIG GPU's instances, by placement: none when the node is taken as empty; its pods' else,
    # less ``freed``'s.
    mig: _MigTaken = {}
    if node.has_mig:
        freed = tuple(freed)
        mig = {
            i: [] if empty else still_taken(g.uuid, g.mig_taken, freed)
            for i, g in enumerate(gpus)
            if g.mig_profiles
        }
    reasons: Counter[str] = Counter()
    devices: PodDevices = []
    running = [list(u) for u in base]  # with the sidecars started so far, then the app containers
    for slot, req in enumerate(ask.slots):
        if req is None:
            devices.append([])
            continue
        alone = slot < ask.n_init and slot not in ask.sidecars
        used = [list(u) for u in running] if alone else running
        wanted = [d.uuid for d in preferred[slot]] if preferred and slot < len(preferred) else []
        chosen = _fit_container(gpus, used, req, ask, wanted, reasons, node.pair_scores, mig)
        if chosen is None:
            return Fit(None, reasons, len(gpus))
        devices.append(_take(gpus, used, chosen, req, mig))
    return Fit(devices, reasons, len(gpus))
