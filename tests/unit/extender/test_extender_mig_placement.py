"""MIG profile and placement choice (hamipy.extender.mig_placement): HAMi's cases and the laws."""

from __future__ import annotations

import itertools

import pytest
from builders import A100_MIG_PROFILES
from hypothesis import given
from hypothesis import strategies as st

from hamipy.extender.mig_placement import (
    by_size,
    can_place,
    ordered_placements,
    overlaps,
    select_candidate,
    select_placement,
)
from hamipy.protocol.devices import MigPlacement, MigProfile


def _p(start: int, size: int) -> MigPlacement:
    return MigPlacement(start, size)


# HAMi's A100 40GB test profiles (pkg/device/nvidia/mig_topology_test.go, mig_capability_test.go).
A100 = A100_MIG_PROFILES[:3]
NAMED = {p.name: p for p in A100}

CAN_PLACE = [
    ([], ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"], True),
    ([_p(4, 4)], ["2g.10gb", "1g.5gb", "1g.5gb"], True),
    ([_p(0, 4), _p(4, 4)], ["1g.5gb"], False),
    ([_p(0, 2), _p(2, 2), _p(4, 2)], ["2g.10gb"], False),
]


@pytest.mark.parametrize(("occupied", "requested", "expected"), CAN_PLACE)
def test_hamis_feasibility_cases(occupied: list[MigPlacement], requested: list[str], expected: bool) -> None:
    assert can_place(A100, occupied, requested) is expected


def test_hamis_sequential_placements() -> None:
    """3g from the top, 2g from the bottom, 1g from the top of what is left."""
    occupied: list[MigPlacement] = []
    for name, start in (("3g.20gb", 4), ("2g.10gb", 0), ("1g.5gb", 3), ("1g.5gb", 2)):
        chosen = select_placement(NAMED[name], occupied)
        assert chosen is not None
        assert chosen.start == start, name
        occupied.append(chosen)


def test_hamis_capability_cases() -> None:
    # TestAddResourceUsageUsesReportedProfileAndPlacement: 10000 MiB takes 2g.10gb at 0.
    assert select_candidate(A100, [], 10000) == (NAMED["2g.10gb"], _p(0, 2))
    # TestCustomFilterUsesReportedPlacementCapacity: three 2g taken, a fourth does not fit, a 1g does.
    full = [_p(0, 2), _p(2, 2), _p(4, 2)]
    assert select_candidate(A100, full, 10000) is None
    assert select_candidate(A100, full, 5000) == (NAMED["1g.5gb"], _p(6, 1))


def test_a_covering_profile_without_room_gives_way_to_a_larger_one() -> None:
    # Every 1g slot overlaps a 2g, except 6: after it, a 5000 MiB ask takes a 3g if one is free.
    taken = [_p(0, 2), _p(2, 2), _p(6, 1)]
    assert select_candidate(A100, taken, 5000) == (NAMED["1g.5gb"], _p(5, 1))
    taken = [_p(0, 2), _p(2, 2), _p(4, 1), _p(5, 1), _p(6, 1)]
    assert select_candidate(A100, taken, 5000) is None


def test_an_ask_past_every_profile_fits_nowhere() -> None:
    assert select_candidate(A100, [], 20481) is None


def test_order_of_placements() -> None:
    assert [p.start for p in ordered_placements(NAMED["1g.5gb"])] == [6, 5, 4, 3, 2, 1, 0]
    assert [p.start for p in ordered_placements(NAMED["2g.10gb"])] == [0, 2, 4]
    assert [p.start for p in ordered_placements(NAMED["3g.20gb"])] == [4, 0]


# -- laws -----------------------------------------------------------------------------------------

SLICES = 8
_placement = st.builds(
    lambda start, size: _p(start, min(size, SLICES - start)),
    st.integers(min_value=0, max_value=SLICES - 1),
    st.integers(min_value=1, max_value=SLICES),
)
_profile = st.builds(
    MigProfile,
    name=st.sampled_from(["1g.a", "2g.b", "3g.c", "4g.d", "7g.e"]),
    memory_mb=st.integers(min_value=1, max_value=8),
    core=st.integers(min_value=0, max_value=100),
    slice_count=st.integers(min_value=1, max_value=8),
    placements=st.lists(_placement, max_size=4, unique=True).map(tuple),
)
_profiles = st.lists(_profile, min_size=1, max_size=4, unique_by=lambda p: p.name).map(tuple)
_occupied = st.lists(_placement, max_size=4)


@given(_profiles, _occupied, st.integers(min_value=0, max_value=9))
def test_a_choice_is_an_nvml_placement_overlapping_nothing(
    profiles: tuple[MigProfile, ...], occupied: list[MigPlacement], memory: int
) -> None:
    chosen = select_candidate(profiles, occupied, memory)
    if chosen is None:
        return
    profile, placement = chosen
    assert profile in profiles
    assert placement in profile.placements  # NVML's only: never past the GPU's slices
    assert profile.memory_mb >= memory
    assert not any(overlaps(placement, taken) for taken in occupied)


@given(_profiles, _occupied, st.integers(min_value=0, max_value=9))
def test_the_choice_is_the_smallest_covering_profile_with_room(
    profiles: tuple[MigProfile, ...], occupied: list[MigPlacement], memory: int
) -> None:
    roomy = [
        p
        for p in by_size(profiles)
        if p.memory_mb >= memory and any(not any(overlaps(c, t) for t in occupied) for c in p.placements)
    ]
    chosen = select_candidate(profiles, occupied, memory)
    assert (chosen[0] if chosen else None) == (roomy[0] if roomy else None)


def _brute_force(
    profiles: tuple[MigProfile, ...], occupied: list[MigPlacement], requested: list[str]
) -> bool:
    """Every assignment of a placement to each request: one whose placements overlap neither each
    other nor the occupied ones (which may overlap each other)."""
    first: dict[str, MigProfile] = {}
    for p in profiles:
        first.setdefault(p.name, p)
    options = [first[name].placements if name in first else () for name in requested]
    for choice in itertools.product(*options):
        mutual = any(overlaps(a, b) for a, b in itertools.combinations(choice, 2))
        if not mutual and not any(overlaps(c, o) for c in choice for o in occupied):
            return True
    return False


@given(_profiles, _occupied, st.lists(st.sampled_from(["1g.a", "2g.b", "3g.c", "4g.d", "7g.e"]), max_size=4))
def test_feasibility_agrees_with_brute_force(
    profiles: tuple[MigProfile, ...], occupied: list[MigPlacement], requested: list[str]
) -> None:
    assert can_place(profiles, occupied, requested) == _brute_force(profiles, occupied, requested)


@given(_profiles, st.lists(st.integers(min_value=0, max_value=9), max_size=8))
def test_successive_choices_never_overlap(profiles: tuple[MigProfile, ...], asks: list[int]) -> None:
    taken: list[MigPlacement] = []
    for memory in asks:
        chosen = select_candidate(profiles, taken, memory)
        if chosen is not None:
            assert not any(overlaps(chosen[1], t) for t in taken)
            taken.append(chosen[1])
