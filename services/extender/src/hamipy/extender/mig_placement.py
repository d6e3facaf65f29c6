"""Which MIG profile and placement a device on a dynamic MIG GPU gets (pure; HAMi's rules,
``pkg/device/nvidia/mig_topology.go`` and ``device.go`` ``selectMigCandidate``).

A GPU's memory is cut into slices; a MIG instance of a profile takes ``size`` slices from
``start``, at one of the placements NVML allows for that profile (``MigProfile.placements``, as the
device plugin registered them). Two instances may not share a slice: placements overlap when their
half-open ranges ``[start, start + size)`` meet. Only NVML's placements are ever chosen, so no
instance reaches past the GPU's slices.

- ``select_candidate``: the smallest profile (by memory, then slice count) whose memory covers the
  ask and that has a free placement. A covering profile with no free placement is passed over for
  a larger one, as HAMi does.
- ``select_placement``: a profile's first free placement, ``1g.`` and ``3g.`` profiles from the
  highest start down and the others from the lowest up (HAMi's order: the small and the half-GPU
  instances pack at the top end, leaving the low slices whole for the large ones).
- ``can_place``: whether a set of profiles fits together beside the occupied placements
  (HAMi's ``canPlaceMigProfiles``, a backtracking search).

A GPU that has the memory for an ask but no free placement of any covering profile is fragmented:
the fit reports it as ``CardMigTopologyInfeasible`` (``hamipy.extender.fitting``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hamipy.protocol.devices import ContainerDevice, MigPlacement, MigProfile
from hamipy.protocol.mig_allocations import MigAllocation

__all__ = [
    "MigGpu",
    "by_size",
    "can_place",
    "ordered_placements",
    "overlaps",
    "plan_allocations",
    "select_candidate",
    "select_placement",
    "still_taken",
]

MigGpu = tuple[Sequence[MigProfile], Sequence[MigPlacement]]
"""A dynamic MIG GPU as the planner sees it: its profiles and the placements taken on it."""


def overlaps(a: MigPlacement, b: MigPlacement) -> bool:
    """Whether two placements share a slice (half-open ranges)."""
    return a.start < b.start + b.size and b.start < a.start + a.size


def still_taken(
    gpu_uuid: str, taken: Sequence[MigPlacement], freed: Iterable[MigAllocation]
) -> list[MigPlacement]:
    """The placements ``taken`` on GPU ``gpu_uuid`` less those ``freed`` holds there (one each:
    two pods never hold one placement, but a model in flux may count one twice)."""
    left = list(taken)
    for allocation in freed:
        if allocation.gpu_uuid == gpu_uuid and allocation.placement in left:
            left.remove(allocation.placement)
    return left


def by_size(profiles: Iterable[MigProfile]) -> tuple[MigProfile, ...]:
    """``profiles`` in the order ``select_candidate`` tries them: memory, then slice count (stable)."""
    return tuple(sorted(profiles, key=lambda p: (p.memory_mb, p.slice_count)))


def ordered_placements(profile: MigProfile) -> tuple[MigPlacement, ...]:
    """The order a profile's placements are tried in: from the highest start for ``1g.`` and
    ``3g.`` profiles, from the lowest for the others (stable among equal starts)."""
    high_first = profile.name.startswith(("1g.", "3g."))
    return tuple(sorted(profile.placements, key=lambda p: -p.start if high_first else p.start))


def select_placement(profile: MigProfile, occupied: Sequence[MigPlacement]) -> MigPlacement | None:
    """The first placement of ``profile``, in ``ordered_placements`` order, that overlaps none of
    ``occupied``; None when every one does."""
    for candidate in ordered_placements(profile):
        if not any(overlaps(candidate, taken) for taken in occupied):
            return candidate
    return None


def select_candidate(
    profiles: Sequence[MigProfile], occupied: Sequence[MigPlacement], memory_mb: int
) -> tuple[MigProfile, MigPlacement] | None:
    """The profile and placement for a device asking ``memory_mb`` MiB, or None: the first profile
    of ``by_size(profiles)`` with at least that memory and a free placement."""
    for profile in by_size(profiles):
        if profile.memory_mb < memory_mb:
            continue
        placement = select_placement(profile, occupied)
        if placement is not None:
            return profile, placement
    return None


def can_place(
    profiles: Sequence[MigProfile], occupied: Sequence[MigPlacement], requested: Sequence[str]
) -> bool:
    """Whether every profile named in ``requested`` (repeats allowed) can have a placement of its
    own beside ``occupied``, none overlapping another. A name no profile has never fits. The
    profiles with the fewest placements, then the largest, are placed first, as HAMi orders them."""
    placements = {p.name: ordered_placements(p) for p in reversed(profiles)}  # the first name wins
    order = sorted(
        requested,
        key=lambda name: (len(placements.get(name, ())), -_first_size(placements.get(name, ()))),
    )
    used = list(occupied)

    def place(i: int) -> bool:
        if i == len(order):
            return True
        for candidate in placements.get(order[i], ()):
            if any(overlaps(candidate, taken) for taken in used):
                continue
            used.append(candidate)
            if place(i + 1):
                return True
            used.pop()
        return False

    return place(0)


def _first_size(placements: Sequence[MigPlacement]) -> int:
    return placements[0].size if placements else 0


def plan_allocations(
    devices: Sequence[Sequence[ContainerDevice]], gpus: Mapping[str, MigGpu]
) -> tuple[MigAllocation, ...] | None:
    """The MIG allocation of each device of a pod's device lists (one slot per container) that is
    on one of ``gpus`` (by UUID), in container and device order, each beside the placements taken
    and those chosen before it; None when one finds no room.

    A fit (``hamipy.extender.fitting``) gives each such device its profile's memory, so planning the
    same devices on the same GPUs chooses what the fit chose."""
    taken: dict[str, list[MigPlacement]] = {}
    out: list[MigAllocation] = []
    for c, slot in enumerate(devices):
        for d, dev in enumerate(slot):
            gpu = gpus.get(dev.uuid)
            if gpu is None:
                continue
            profiles, occupied = gpu
            mine = taken.setdefault(dev.uuid, [])
            chosen = select_candidate(profiles, [*occupied, *mine], dev.usedmem)
            if chosen is None:
                return None
            mine.append(chosen[1])
            out.append(MigAllocation(c, d, dev.uuid, chosen[0].name, chosen[1]))
    return tuple(out)
