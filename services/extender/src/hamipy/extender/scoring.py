"""Scores: how nodes and GPUs are ranked under the node and GPU policies (pure).

Both follow HAMi's ``pkg/scheduler/policy``:

- a node's score is the sum of its slot, core and memory usage ratios *before* the pod is placed
  (``NodeScore.ComputeScore``); ``binpack`` takes the highest, ``spread`` the lowest;
- a GPU's score is the weighted sum of its slot, core and memory usage ratios *with* the request
  added (``DeviceListsScore.ComputeScore``, weights from ``hami.io/device-scoring-weights``).

The GPU policy (``GpuRule.of``: the pod's ``hami.io/gpu-scheduler-policy``, else the configured
one, taken whole) orders a node's GPUs by keys, as HAMi's ``DeviceUsageList.Less``:

- one policy: ``binpack`` tries the highest score first, ``spread`` (and ``topology-aware``, which
  ranks as spread) the lowest; equal scores go to the higher NUMA id. ``mutex`` tries idle GPUs
  first, the higher NUMA id first. Remaining ties go to the lower NVML index (HAMi leaves them to
  an unstable sort);
- a chain (``binpack,numa``) or ``numa`` alone: its ``binpack``, ``spread`` and ``numa`` keys in
  the order written (``numa``: the higher NUMA id first), ``spread`` when it names none; remaining
  ties go to the higher NVML index, as HAMi's chain does.

``mutex`` and ``topology-aware`` anywhere in the chain are also rules of the fit (``GpuRule.mutex``,
``GpuRule.topology``: ``hamipy.extender.fitting``). ``nvidia.com/numa-bind`` is the constraint
that a container's GPUs share a NUMA node, also applied there.

``prioritize_score`` turns a node score into the 0-10 of an extender's HostPriorityList.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Final, Literal

from hamipy.extender.model import Gpu
from hamipy.protocol.pod_preferences import GpuPolicy, ScoringWeights
from hamipy.protocol.resources import ContainerRequest, memory_for_device

__all__ = [
    "MAX_PRIORITY",
    "GpuRule",
    "Policy",
    "SortKey",
    "gpu_order",
    "gpu_score",
    "node_rank_key",
    "prioritize_score",
    "rank",
]

Policy = Literal["binpack", "spread"]
SortKey = Literal["binpack", "spread", "numa", "idle"]
_CHAIN_KEYS: Final[Mapping[str, SortKey]] = {"binpack": "binpack", "spread": "spread", "numa": "numa"}
MAX_PRIORITY: Final = 10
# A node score is three ratios, each 0-1 (above 1 only when a node is over-committed).
_MAX_NODE_SCORE: Final = 3.0


@dataclasses.dataclass(frozen=True, slots=True)
class GpuRule:
    """How a pod's GPU policy ranks and filters a node's GPUs (see the module docstring)."""

    keys: tuple[SortKey, ...] = ("spread", "numa")
    """Sort keys, most significant first; the NVML index breaks the remaining ties."""
    chained: bool = False
    """HAMi's chain order: remaining ties go to the higher index (else the lower)."""
    mutex: bool = False
    """Only GPUs nothing is allocated on (``ExclusiveDeviceAllocateConflict`` for the others)."""
    topology: bool = False
    """Among the GPUs that fit, the best-linked set (``hamipy.extender.topology``)."""

    @classmethod
    def of(cls, chain: Sequence[GpuPolicy]) -> GpuRule:
        """The rule of a policy chain as parsed (``parse_gpu_policy``); empty means ``spread``."""
        mutex, topology = "mutex" in chain, "topology-aware" in chain
        if len(chain) > 1 or tuple(chain) == ("numa",):
            keys = tuple(k for p in chain if (k := _CHAIN_KEYS.get(p)) is not None) or ("spread",)
            return cls(keys, chained=True, mutex=mutex, topology=topology)
        single = chain[0] if chain else "spread"
        first: SortKey = "binpack" if single == "binpack" else "idle" if single == "mutex" else "spread"
        return cls((first, "numa"), mutex=mutex, topology=topology)


def gpu_score(gpu: Gpu, used: Sequence[int], request: ContainerRequest, weights: ScoringWeights) -> float:
    """HAMi's device score: usage ratios including this request, weighted."""
    slots, mem, cores = used
    need_mem = memory_for_device(request, gpu.devmem)
    score = 0.0
    if gpu.count:
        score += weights.slot * (slots + 1) / gpu.count
    if gpu.devcore:
        score += weights.core * (cores + request.cores) / gpu.devcore
    if gpu.devmem:
        score += weights.memory * (mem + need_mem) / gpu.devmem
    return score


def gpu_order(
    gpus: Sequence[Gpu],
    used: Sequence[Sequence[int]],
    request: ContainerRequest,
    *,
    rule: GpuRule,
    weights: ScoringWeights,
) -> list[int]:
    """Positions of ``gpus`` in the order they are tried: best first for the rule."""
    scores = (
        [gpu_score(g, used[i], request, weights) for i, g in enumerate(gpus)]
        if "binpack" in rule.keys or "spread" in rule.keys
        else []
    )
    return rank(gpus, used, scores, rule=rule)


def rank(
    gpus: Sequence[Gpu], used: Sequence[Sequence[int]], scores: Sequence[float], *, rule: GpuRule
) -> list[int]:
    """Positions of ``gpus`` best first for ``rule``, given their scores (``gpu_score``; read only
    when a key is ``binpack`` or ``spread``) and usage (slots first)."""
    columns: list[Sequence[float]] = []
    for key in rule.keys:
        if key == "numa":
            columns.append([-g.numa for g in gpus])
        elif key == "idle":
            columns.append([used[i][0] for i in range(len(gpus))])
        else:
            columns.append([-s for s in scores] if key == "binpack" else scores)
    columns.append([-g.index if rule.chained else g.index for g in gpus])
    return sorted(range(len(gpus)), key=list(zip(*columns, strict=True)).__getitem__)


def node_rank_key(score: float, policy: Policy) -> float:
    """Sort key, smallest first: binpack prefers busy nodes, spread idle ones."""
    return -score if policy == "binpack" else score


def prioritize_score(score: float, policy: Policy) -> int:
    """A node score as 0-10 (cooperative mode's /prioritize): 10 is the policy's favourite."""
    fraction = min(max(score / _MAX_NODE_SCORE, 0.0), 1.0)
    if policy == "spread":
        fraction = 1.0 - fraction
    return round(fraction * MAX_PRIORITY)
