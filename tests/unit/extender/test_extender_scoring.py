"""Scores (``hamipy.extender.scoring``, pure): HAMi's weighted GPU score, the order GPUs are tried in
under binpack and spread, and a node score as kube-scheduler's 0-10."""

from __future__ import annotations

import itertools

import pytest
from builders import gpu
from hypothesis import given, settings
from hypothesis import strategies as st

from hamipy.extender.model import Gpu
from hamipy.extender.scoring import (
    MAX_PRIORITY,
    GpuRule,
    gpu_order,
    gpu_score,
    node_rank_key,
    prioritize_score,
)
from hamipy.protocol.pod_preferences import ScoringWeights, parse_gpu_policy
from hamipy.protocol.resources import ContainerRequest

EVEN = ScoringWeights()
UNEVEN = ScoringWeights(slot=1, core=2, memory=3)
QUARTER = Gpu.of(gpu("G", count=4, mem=1000, core=100))
"""A GPU split 4 ways with 1000 MiB and 100 cores: every ratio below is a round number."""


def ask(*, mem: int | None = 300, percent: int | None = None, cores: int = 20) -> ContainerRequest:
    return ContainerRequest(
        count=1, memory_mib=mem if percent is None else None, memory_percentage=percent, cores=cores
    )


# -- one GPU's score ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("used", "request_", "weights", "score"),
    [
        # (1+1)/4 slots + (30+20)/100 cores + (200+300)/1000 MiB
        pytest.param((1, 200, 30), ask(), EVEN, 0.5 + 0.5 + 0.5, id="even-weights"),
        pytest.param((1, 200, 30), ask(), UNEVEN, 0.5 + 2 * 0.5 + 3 * 0.5, id="uneven-weights"),
        pytest.param((0, 0, 0), ask(mem=100, cores=0), EVEN, 0.25 + 0.0 + 0.1, id="empty-gpu"),
        pytest.param((3, 900, 80), ask(mem=100, cores=20), UNEVEN, 1.0 + 2 * 1.0 + 3 * 1.0, id="filled-up"),
        pytest.param((0, 100, 0), ask(percent=25, cores=10), EVEN, 0.25 + 0.1 + 0.35, id="memory-percentage"),
        pytest.param((1, 200, 30), ask(), ScoringWeights(1, 0, 0), 0.5, id="slots-only"),
        pytest.param((1, 200, 30), ask(), ScoringWeights(0, 1, 0), 0.5, id="cores-only"),
        pytest.param((1, 200, 30), ask(), ScoringWeights(0, 0, 1), 0.5, id="memory-only"),
    ],
)
def test_gpu_score_is_hamis_weighted_usage_with_the_request_added(
    used: tuple[int, int, int], request_: ContainerRequest, weights: ScoringWeights, score: float
) -> None:
    assert gpu_score(QUARTER, used, request_, weights) == pytest.approx(score)


def test_gpu_score_skips_a_dimension_the_gpu_has_none_of() -> None:
    no_cores = Gpu.of(gpu("G", count=4, mem=1000, core=0))
    nothing = Gpu.of(gpu("G", count=0, mem=0, core=0))
    assert gpu_score(no_cores, (1, 200, 0), ask(), EVEN) == pytest.approx(0.5 + 0.5)
    assert gpu_score(nothing, (0, 0, 0), ask(), EVEN) == 0.0


# -- the order GPUs are tried in ---------------------------------------------------------------------


def rule(policy: str) -> GpuRule:
    return GpuRule.of(parse_gpu_policy(policy))


FOUR = [Gpu.of(gpu(f"G{i}", i, count=4, mem=1000, core=100)) for i in range(4)]


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        pytest.param("binpack", [2, 0, 3, 1], id="binpack-busiest-first"),
        pytest.param("spread", [1, 0, 3, 2], id="spread-idlest-first"),
    ],
)
def test_gpu_order_follows_the_policy_ties_by_index(policy: str, order: list[int]) -> None:
    # G0 and G3 are equally used (on one NUMA node): the lower index goes first under either policy.
    used = [(1, 100, 10), (0, 0, 0), (3, 500, 50), (1, 100, 10)]
    assert gpu_order(FOUR, used, ask(), rule=rule(policy), weights=EVEN) == order


def test_gpu_order_weighs_what_the_pod_says_matters() -> None:
    # G0 has more slots taken, G1 more memory: the weights decide which is "busier".
    used = [(3, 0, 0), (0, 900, 0)]
    two = FOUR[:2]
    assert gpu_order(two, used, ask(), rule=rule("binpack"), weights=ScoringWeights(10, 0, 1)) == [0, 1]
    assert gpu_order(two, used, ask(), rule=rule("binpack"), weights=ScoringWeights(1, 0, 10)) == [1, 0]


USAGES = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=4),
        st.integers(min_value=0, max_value=1000),
        st.integers(min_value=0, max_value=100),
    ),
    min_size=4,
    max_size=4,
)


@settings(max_examples=100, deadline=None)
@given(USAGES)
def test_gpu_order_law_binpack_scores_fall_spread_scores_rise(used: list[tuple[int, int, int]]) -> None:
    request_ = ask()
    scores = [gpu_score(g, u, request_, EVEN) for g, u in zip(FOUR, used, strict=True)]
    binpack = gpu_order(FOUR, used, request_, rule=rule("binpack"), weights=EVEN)
    spread = gpu_order(FOUR, used, request_, rule=rule("spread"), weights=EVEN)
    assert sorted(binpack) == sorted(spread) == [0, 1, 2, 3]
    for first, second in itertools.pairwise(binpack):
        assert (-scores[first], first) < (-scores[second], second)
    for first, second in itertools.pairwise(spread):
        assert (scores[first], first) < (scores[second], second)


# -- nodes -------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=3.0), min_size=1, max_size=8))
def test_node_rank_key_law_binpack_busiest_first_spread_idlest_first(scores: list[float]) -> None:
    assert sorted(scores, key=lambda s: node_rank_key(s, "binpack")) == sorted(scores, reverse=True)
    assert sorted(scores, key=lambda s: node_rank_key(s, "spread")) == sorted(scores)


@pytest.mark.parametrize(
    ("score", "binpack", "spread"),
    [
        pytest.param(0.0, 0, 10, id="idle"),
        pytest.param(0.3, 1, 9, id="a-tenth-used"),
        pytest.param(1.5, 5, 5, id="half-used"),
        pytest.param(2.4, 8, 2, id="mostly-used"),
        pytest.param(3.0, 10, 0, id="full"),
        pytest.param(4.5, 10, 0, id="over-committed-clamps"),
        pytest.param(-1.0, 0, 10, id="below-zero-clamps"),
    ],
)
def test_prioritize_score_maps_a_node_score_to_0_10_favouring_the_policy(
    score: float, binpack: int, spread: int
) -> None:
    assert prioritize_score(score, "binpack") == binpack
    assert prioritize_score(score, "spread") == spread


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-10.0, max_value=10.0), st.floats(min_value=-10.0, max_value=10.0))
def test_prioritize_score_law_in_range_and_monotone(a: float, b: float) -> None:
    low, high = sorted((a, b))
    for policy in ("binpack", "spread"):
        assert 0 <= prioritize_score(low, policy) <= MAX_PRIORITY
    assert prioritize_score(low, "binpack") <= prioritize_score(high, "binpack")
    assert prioritize_score(low, "spread") >= prioritize_score(high, "spread")
