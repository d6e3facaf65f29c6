"""The topology-aware search (``hamipy.extender.topology``, pure): HAMi's cases for the pick of one
GPU and of a set, its ties, and the bound on the search (exact up to ``EXACT_PAIRS`` pair
reads, greedy beyond) as properties."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hamipy.extender.topology import exact, pick_gpus, set_score

# HAMi's pkg/device/nvidia/device_test.go: three GPUs and their pair scores.
THREE: Mapping[str, Mapping[str, int]] = {
    "gpu0": {"gpu1": 100, "gpu2": 200},
    "gpu1": {"gpu0": 100, "gpu2": 150},
    "gpu2": {"gpu0": 200, "gpu1": 150},
}
NEGATIVE: Mapping[str, Mapping[str, int]] = {
    "gpu0": {"gpu1": -5, "gpu2": -3},
    "gpu1": {"gpu0": -5, "gpu2": -1},
    "gpu2": {"gpu0": -3, "gpu1": -1},
}
IDS = ["gpu0", "gpu1", "gpu2"]


def picked(
    candidates: list[str], count: int, scores: Mapping[str, Mapping[str, int]], **kw: int
) -> list[str]:
    return [candidates[p] for p in pick_gpus(candidates, count, scores, **kw)]


@pytest.mark.parametrize(
    ("scores", "count", "want"),
    [
        pytest.param(THREE, 1, ["gpu1"], id="worst-single-card: totals 300/250/350"),
        pytest.param(THREE, 2, ["gpu0", "gpu2"], id="best-combination: pairs 100/200/150"),
        pytest.param(NEGATIVE, 1, ["gpu0"], id="negative-single: totals -8/-6/-4"),
        pytest.param(NEGATIVE, 2, ["gpu1", "gpu2"], id="negative-pair: pairs -5/-3/-1"),
        pytest.param({}, 2, ["gpu0", "gpu1"], id="no-scores: the first candidates"),
        pytest.param({}, 1, ["gpu0"], id="no-scores-single: the first candidate"),
        pytest.param(THREE, 3, IDS, id="as-many-as-asked: all, scores unread"),
    ],
)
def test_hamis_cases(scores: Mapping[str, Mapping[str, int]], count: int, want: list[str]) -> None:
    assert picked(IDS, count, scores) == want


def test_a_gpu_missing_from_the_scores_counts_zero() -> None:
    # HAMi panics on a candidate absent from the node's scores; it scores 0 here.
    assert picked(["gpu0", "gpu1", "gpu2", "gpuX"], 2, THREE) == ["gpu0", "gpu2"]
    assert picked(["gpu0", "gpu1", "gpu2", "gpuX"], 1, THREE) == ["gpuX"], "least linked: 0"


def test_the_set_is_read_in_the_row_of_its_earlier_candidate() -> None:
    one_way = {"a": {"b": 10}, "b": {"a": 0, "c": 5}, "c": {"b": 50}}
    assert picked(["a", "b", "c"], 2, one_way) == ["a", "b"], "a-b 10 > b-c 5 (c's row unread)"
    assert picked(["c", "b", "a"], 2, one_way) == ["c", "b"], "c-b 50 > b-a 0"


# -- 8 GPUs as the fake driver's presets score them ------------------------------------------------


def pcie_pairs8() -> dict[str, dict[str, int]]:
    """GPUs 2k and 2k+1 bridged by 12 NVLinks and a PCIe switch (1250); NODE (20) within a NUMA
    node (GPUs 0-3, 4-7), SYS (10) across."""
    return {
        f"G{i}": {f"G{j}": 1250 if j == i ^ 1 else 20 if i // 4 == j // 4 else 10 for j in range(8) if j != i}
        for i in range(8)
    }


def test_two_gpus_on_pcie_pairs_are_a_bridged_pair() -> None:
    order = [f"G{i}" for i in (4, 6, 1, 5, 0, 7, 2, 3)]
    assert sorted(picked(order, 2, pcie_pairs8())) == ["G4", "G5"]


def test_one_gpu_on_pcie_pairs_takes_the_one_whose_partner_is_gone() -> None:
    order = [f"G{i}" for i in (4, 5, 6, 7, 1, 2, 3)]  # G0 is full: not a candidate
    assert picked(order, 1, pcie_pairs8()) == ["G1"]


def test_four_gpus_on_pcie_pairs_are_two_pairs_on_one_numa_node() -> None:
    order = [f"G{i}" for i in range(8)]
    assert picked(order, 4, pcie_pairs8()) == ["G0", "G1", "G2", "G3"]


# -- the bound ----------------------------------------------------------------------------------------


def brute_force(candidates: list[str], count: int, scores: Mapping[str, Mapping[str, int]]) -> int:
    n = len(candidates)
    pair = [
        [scores.get(candidates[min(i, j)], {}).get(candidates[max(i, j)], 0) for j in range(n)]
        for i in range(n)
    ]
    return max(set_score(pair, c) for c in itertools.combinations(range(n), count))


def score_of(candidates: list[str], chosen: list[int], scores: Mapping[str, Mapping[str, int]]) -> int:
    total = 0
    for a, b in itertools.combinations(sorted(chosen), 2):
        total += scores.get(candidates[a], {}).get(candidates[b], 0)
    return total


@st.composite
def nodes(draw: st.DrawFn, max_gpus: int = 10) -> tuple[list[str], int, dict[str, dict[str, int]]]:
    n = draw(st.integers(2, max_gpus))
    count = draw(st.integers(2, n))
    ids = [f"G{i}" for i in range(n)]
    values = st.integers(-50, 2000)
    scores = {a: {b: draw(values) for b in ids if b != a} for a in ids}
    return ids, count, scores


@settings(max_examples=150, deadline=None)
@given(nodes())
def test_the_exact_search_finds_the_best_set(node: tuple[list[str], int, dict[str, dict[str, int]]]) -> None:
    ids, count, scores = node
    chosen = pick_gpus(ids, count, scores, exact_pairs=math.comb(len(ids), count) * count * count)
    assert chosen == sorted(set(chosen))
    assert len(chosen) == count
    assert score_of(ids, chosen, scores) == brute_force(ids, count, scores)


@settings(max_examples=150, deadline=None)
@given(nodes())
def test_the_greedy_search_takes_a_valid_set_no_better_than_the_best(
    node: tuple[list[str], int, dict[str, dict[str, int]]],
) -> None:
    ids, count, scores = node
    chosen = pick_gpus(ids, count, scores, exact_pairs=0)
    assert chosen == sorted(set(chosen))
    assert len(chosen) == count
    assert score_of(ids, chosen, scores) <= brute_force(ids, count, scores)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([2, 4, 8]), st.integers(1, 16))
def test_the_greedy_search_takes_whole_groups_of_a_grouped_node(seed: int, group: int, count: int) -> None:
    # 16 GPUs in groups (bridged pairs, quads, planes): within a group a high score, across a low
    # one; a set of whole groups and then part of one is the best, and the greedy search finds it.
    rng = random.Random(seed)
    ids = [f"G{i}" for i in range(16)]
    rng.shuffle(ids)
    within, across = rng.randint(500, 2000), rng.randint(0, 40)
    scores = {
        a: {b: within if int(a[1:]) // group == int(b[1:]) // group else across for b in ids if b != a}
        for a in ids
    }
    chosen = pick_gpus(ids, count, scores, exact_pairs=0)
    full, rest = divmod(count, group)
    best = (full * group * (group - 1) + rest * (rest - 1)) // 2 * within
    best += (count * (count - 1) // 2 - (full * group * (group - 1) + rest * (rest - 1)) // 2) * across
    assert score_of(ids, chosen, scores) == best


@pytest.mark.parametrize(("n", "exactly"), [(8, list(range(2, 8))), (16, [2])])
def test_which_requests_are_searched_exactly(n: int, exactly: list[int]) -> None:
    assert [k for k in range(2, n) if exact(n, k)] == exactly
