"""Scores: how nodes and GPUs are ranked under the binpack and spread policies (pure).

Both follow HAMi's ``pkg/scheduler/policy``:

- a node's score is the sum of its slot, core and memory usage ratios *before* the pod is placed
  (``NodeScore.ComputeScore``); ``binpack`` takes the highest, ``spread`` the lowest;
- a GPU's score is the weighted sum of its slot, core and memory usage ratios *with* the request
  added (``DeviceListsScore.ComputeScore``, weights from ``hami.io/device-scoring-weights``);
  ``binpack`` tries the highest first, ``spread`` the lowest. Ties go to the lower NVML index.

``prioritize_score`` turns a node score into the 0-10 of an extender's HostPriorityList.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

from hamipy.extender.model import Gpu
from hamipy.protocol.pod_preferences import ScoringWeights
from hamipy.protocol.resources import ContainerRequest, memory_for_device

__all__ = ["MAX_PRIORITY", "Policy", "gpu_order", "gpu_score", "node_rank_key", "prioritize_score"]

Policy = Literal["binpack", "spread"]
MAX_PRIORITY: Final = 10
# A node score is three ratios, each 0-1 (above 1 only when a node is over-committed).
_MAX_NODE_SCORE: Final = 3.0


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
    policy: Policy,
    weights: ScoringWeights,
) -> list[int]:
    """Positions of ``gpus`` in the order they are tried: best first for the policy."""
    scores = [gpu_score(g, used[i], request, weights) for i, g in enumerate(gpus)]
    if policy == "binpack":
        return sorted(range(len(gpus)), key=lambda i: (-scores[i], gpus[i].index))
    return sorted(range(len(gpus)), key=lambda i: (scores[i], gpus[i].index))


def node_rank_key(score: float, policy: Policy) -> float:
    """Sort key, smallest first: binpack prefers busy nodes, spread idle ones."""
    return -score if policy == "binpack" else score


def prioritize_score(score: float, policy: Policy) -> int:
    """A node score as 0-10 (cooperative mode's /prioritize): 10 is the policy's favourite."""
    fraction = min(max(score / _MAX_NODE_SCORE, 0.0), 1.0)
    if policy == "spread":
        fraction = 1.0 - fraction
    return round(fraction * MAX_PRIORITY)
