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

HAMi enumerates every set, C(C, N) of them: 70 at most on 8 GPUs, 12,870 for 8 of 16, each summed
over N(N-1)/2 pairs. Here the search is exact while the sets number at most ``EXACT_SETS`` (every
request among up to 10 candidates; 1, 2 and 14 to 16 GPUs of 16), and greedy beyond: from each
candidate as a seed, add the candidate that adds most to the set (the first on ties) until N are
taken, and keep the best set (the first seed's on ties): C x (N - 1) steps of about 2C operations,
under 4,000 for any N of 16 candidates. A node's
links come in groups (NVLink-bridged pairs or quads, NVSwitch planes, PCIe switches, NUMA nodes),
and growing a set from a seed inside the best group takes that group before anything outside it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["EXACT_SETS", "PairScores", "pick_gpus", "set_score"]

PairScores = Mapping[str, Mapping[str, int]]
"""Per GPU UUID the score to each other GPU (``NodeScores``)."""

EXACT_SETS: Final = 256
"""Most sets searched exactly: 256 sets of at most 10 GPUs cost about as much as the greedy search
on 16 GPUs (about 2,000 additions), a fraction of a millisecond."""


def pick_gpus(
    candidates: Sequence[str], count: int, scores: PairScores, *, exact_sets: int = EXACT_SETS
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
    if math.comb(n, count) <= exact_sets:
        return _exact(pair, count)
    return _greedy(pair, count)


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
    best_total = 0
    for seed in range(n):
        chosen = [seed]
        taken = [False] * n
        taken[seed] = True
        gain = list(pair[seed])  # what each candidate adds to the set so far
        total = 0
        while len(chosen) < count:
            step = max((j for j in range(n) if not taken[j]), key=gain.__getitem__)
            chosen.append(step)
            taken[step] = True
            total += gain[step]
            row = pair[step]
            for j in range(n):
                gain[j] += row[j]
        if not best or total > best_total:
            best, best_total = sorted(chosen), total
    return best
