"""Which GPUs a topology-aware container takes among those that fit it (pure).

The candidates are the node's GPUs that pass every fit check, in the order the GPU policy tries
them; the scores are the node's ``hami.io/node-nvidia-score`` (``hamipy.protocol.node_scores``),
a pair missing from them scoring 0. As HAMi's ``NvidiaGPUDevices.Fit``:

- as many candidates as GPUs asked: those, scores unread;
- one GPU: the candidate least linked to the other candidates (the smallest sum of its row over
  them), which keeps well-linked groups free for the pods that need a group; the first wins ties;
- N GPUs: the set with the highest sum of pair scores, each pair read in the row of its earlier
  candidate; the first set in lexicographic order of candidate positions wins ties, so with no
  scores the pick is the first N candidates, what the policy alone would take.

HAMi enumerates every set, C(C, N) of them, each summed over its N(N-1)/2 pairs: 70 x 6 pairs for 4
of 8 GPUs, 12,870 x 28 for 8 of 16. Here the search is exact while that work (pairs read) is at
most ``EXACT_PAIRS``, which holds every request among up to 8 candidates and 2 of 16, and greedy
beyond: from each candidate as a seed, add the candidate that adds most to the set (the
first on ties) until N are taken, and keep the best set (the first seed's on ties). That is C x
(N - 1) steps, each a pass over the C candidates: under 4,000 for any N of 16, so a 16-GPU node's
search is bounded by C^2 x N, not by C(C, N). A node's
links come in groups (NVLink-bridged pairs or quads, NVSwitch planes, PCIe switches, NUMA nodes),
and growing a set from a seed inside the best group takes that group before anything outside it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["EXACT_PAIRS", "PairScores", "exact", "pick_gpus", "set_score"]

PairScores = Mapping[str, Mapping[str, int]]
"""Per GPU UUID the score to each other GPU (``NodeScores``)."""

EXACT_PAIRS: Final = 600
"""Most pair scores an exact search reads: every request on an 8-GPU node (at most 56 sets x 10
pairs) is exact, and no exact search costs more than a greedy one on 16 candidates
(``tests/bench/bench_extender.py``: tens of microseconds against hundreds)."""
_TAKEN: Final = float("-inf")


def pick_gpus(
    candidates: Sequence[str], count: int, scores: PairScores, *, exact_pairs: int = EXACT_PAIRS
) -> list[int]:
    """Positions in ``candidates`` (UUIDs, in the order tried) of the ``count`` GPUs to take, in
    that order; ``count`` is at least 1 and at most ``len(candidates)``."""
    n = len(candidates)
    if count >= n:
        return list(range(n))
    empty: Mapping[str, int] = {}
    rows = [scores.get(uuid, empty) for uuid in candidates]
    if count == 1:
        # Each candidate's row over the others (a GPU's score to itself, were one given, left out).
        totals = [
            sum(row.get(other, 0) for other in candidates) - row.get(uuid, 0)
            for uuid, row in zip(candidates, rows, strict=True)
        ]
        return [totals.index(min(totals))]
    # The score of a pair, read in the row of its earlier candidate, both ways round.
    pair = [[0] * n for _ in range(n)]
    for i in range(n):
        row = rows[i]
        for j in range(i + 1, n):
            pair[i][j] = pair[j][i] = row.get(candidates[j], 0)
    if exact(n, count, exact_pairs=exact_pairs):
        return _exact(pair, count)
    return _greedy(pair, count)


def exact(candidates: int, count: int, *, exact_pairs: int = EXACT_PAIRS) -> bool:
    """Whether ``count`` GPUs of ``candidates`` are searched exactly (else greedily)."""
    return math.comb(candidates, count) * count * (count - 1) // 2 <= exact_pairs


def set_score(pair: Sequence[Sequence[int]], chosen: Sequence[int]) -> int:
    """The sum of the pair scores within ``chosen`` (positions)."""
    return sum(pair[a][b] for a, b in itertools.combinations(chosen, 2))


def _exact(pair: list[list[int]], count: int) -> list[int]:
    best: tuple[int, ...] = ()
    best_total = 0
    for chosen in itertools.combinations(range(len(pair)), count):
        total = set_score(pair, chosen)
        if not best or total > best_total:
            best, best_total = chosen, total
    return list(best)


def _greedy(pair: list[list[int]], count: int) -> list[int]:
    n = len(pair)
    best: list[int] = []
    best_total = 0.0
    for seed in range(n):
        chosen = [seed]
        gain: list[float] = list(pair[seed])  # what each candidate adds to the set so far
        gain[seed] = _TAKEN  # stays taken: -inf plus any score
        total = 0.0
        for _ in range(count - 1):
            step = max(range(n), key=gain.__getitem__)
            chosen.append(step)
            total += gain[step]
            gain = [g + s for g, s in zip(gain, pair[step], strict=True)]
            gain[step] = _TAKEN
        if not best or total > best_total:
            best, best_total = sorted(chosen), total
    return best
