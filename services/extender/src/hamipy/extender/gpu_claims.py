"""Which node a GPU counts on when several nodes register its UUID (pure).

A UUID names one physical GPU. Two nodes registering the same one means a misconfigured or
compromised device plugin (a cloned machine image, a plugin writing what another node holds);
offering it through both would book one GPU twice. So one node **owns** each UUID: the one whose
Node object is oldest (``creationTimestamp``, then name). Every replica and every restart computes
that alike from the nodes as they are, whatever order the watch delivered them in, so a new leader
never offers the GPU through another node than the old one did. The other nodes' entries for it are
**refused**: never offered, and the pods bound there on it count against the owner's entry too, as
they run on the same GPU. When the owner goes (its Node deleted, or its register no longer lists
the UUID), the next oldest takes it over, with every pod on it counted.

A GPU registered with 0 MiB of memory is refused too (``ZERO_MEMORY``): its memory is what every
slice's limit is cut from, and 0 is no size a GPU has (an NVML read that failed, or a lie). It
claims no UUID: another node's healthy entry for the same GPU owns it.

Usage bookkeeping: a refused duplicate (``Gpu.owner`` set) holds its own pods' usage, and its owner
holds its own plus every duplicate's, so a filter of the owner sees all of it. ``ClusterModel``
adds each pod's usage to both (``_add_usage``); here, re-owning a UUID moves the duplicates' usage
from the old owner to the new one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from hamipy.extender.model import Gpu, NodeState
    from hamipy.protocol.identifiers import GpuUuid, NodeName

__all__ = ["DUPLICATE_UUID", "ZERO_MEMORY", "ClaimChange", "GpuClaims", "Rank", "rank_of", "refusal_text"]

DUPLICATE_UUID: Final = "duplicate-uuid"
"""``Gpu.refused``: an older node registers the same UUID and owns it."""
ZERO_MEMORY: Final = "zero-memory"
"""``Gpu.refused``: registered with 0 MiB of memory."""

Rank = tuple[str, str]
"""(creationTimestamp, name): the smallest owns a UUID. RFC 3339 times in UTC, as the API server
writes them, sort as text."""


def rank_of(created: str, name: str) -> Rank:
    """Where a node registering a UUID stands: the smallest owns it."""
    return created, name


def _rank(state: NodeState) -> Rank:
    return rank_of(state.created, state.name)


def _claimable(state: NodeState | None) -> list[Gpu]:
    return [] if state is None else [g for g in state.gpus if g.refused != ZERO_MEMORY]


def refusal_text(gpu: Gpu) -> str:
    """Why ``gpu`` is not scheduled, as an Event on its node says it."""
    what = f"GPU {gpu.uuid} (index {gpu.index}) is not scheduled"
    if gpu.refused == ZERO_MEMORY:
        return f"{what}: it is registered with 0 MiB of memory, the size every slice is cut from"
    owner = gpu.owner.node if gpu.owner is not None else "an older node"
    return (
        f"{what}: node {owner} registers the same GPU UUID and its Node is older; one GPU is never "
        f"offered through two nodes, and the pods bound here on it count against {owner}'s"
    )


@dataclasses.dataclass(slots=True)
class ClaimChange:
    """What re-owning some UUIDs changed: the nodes whose GPUs' refusal or usage changed (their
    summaries are stale), the GPUs newly refused as duplicates, and those offered again."""

    nodes: set[NodeName] = dataclasses.field(default_factory=set)
    refused: list[Gpu] = dataclasses.field(default_factory=list)
    accepted: list[Gpu] = dataclasses.field(default_factory=list)


class GpuClaims:
    """Per UUID, the nodes registering it and their entry for it."""

    def __init__(self) -> None:
        self._claims: dict[GpuUuid, dict[NodeName, tuple[Rank, Gpu]]] = {}

    def replace(self, old: NodeState | None, new: NodeState | None) -> ClaimChange:
        """``old``'s GPUs give way to ``new``'s (None: the node is new, or gone): each UUID either
        registers is owned again. ``new``'s GPUs hold their own pods' usage already."""
        uuids = {g.uuid for g in (*_claimable(old), *_claimable(new))}
        change = ClaimChange()
        before: dict[tuple[NodeName, GpuUuid], bool] = {}
        for uuid in uuids:
            group = self._claims.get(uuid, {})
            for name, (_, gpu) in group.items():
                before[(name, uuid)] = gpu.refused == DUPLICATE_UUID
            self._dissolve(group, change)
        if old is not None:
            for gpu in _claimable(old):
                group = self._claims.get(gpu.uuid, {})
                entry = group.get(old.name)
                if entry is not None and entry[1] is gpu:
                    del group[old.name]
        if new is not None:
            for gpu in _claimable(new):
                self._claims.setdefault(gpu.uuid, {})[new.name] = (_rank(new), gpu)
        for uuid in uuids:
            claimants = self._claims.get(uuid)
            if not claimants:
                self._claims.pop(uuid, None)
                continue
            self._form(claimants, change)
            for name, (_, gpu) in claimants.items():
                was, now = before.get((name, uuid), False), gpu.refused == DUPLICATE_UUID
                if now and not was:
                    change.refused.append(gpu)
                elif was and not now:
                    change.accepted.append(gpu)
        return change

    def overlay(self, state: NodeState) -> None:
        """Apply to ``state``, a node rebuilt from fresh API state alone (a bind's re-check under the
        node lock), what the other nodes' registers mean for it: its entries for a UUID an older node
        registers are refused, and those it owns count the other nodes' pods on that GPU."""
        mine = _rank(state)
        for gpu in state.gpus:
            if gpu.refused is not None:
                continue
            group = list(self._claims.get(gpu.uuid, {}).items())
            others = [entry for name, entry in group if name != state.name]
            if not others:
                continue
            if min(rank for rank, _ in others) < mine:
                gpu.refused = DUPLICATE_UUID
                continue
            for other in others:
                slots, mem, cores = _own(other, [entry for _, entry in group])
                gpu.used_slots += slots
                gpu.used_mem += mem
                gpu.used_cores += cores
        state.refresh_summary()

    @staticmethod
    def _dissolve(group: dict[NodeName, tuple[Rank, Gpu]], change: ClaimChange) -> None:
        """Undo ``_form``: each duplicate's usage leaves its owner, and nothing is refused as one."""
        for _, gpu in group.values():
            owner = gpu.owner
            if owner is None:
                continue
            owner.used_slots -= gpu.used_slots
            owner.used_mem -= gpu.used_mem
            owner.used_cores -= gpu.used_cores
            gpu.owner = None
            gpu.refused = None
            change.nodes.update((owner.node, gpu.node))

    @staticmethod
    def _form(group: dict[NodeName, tuple[Rank, Gpu]], change: ClaimChange) -> None:
        """The oldest node owns the UUID; the others' entries are refused, their usage added to it."""
        if len(group) < 2:
            change.nodes.update(gpu.node for _, gpu in group.values())
            return
        ranked = sorted(group.values(), key=lambda entry: entry[0])
        owner = ranked[0][1]
        for _, gpu in ranked[1:]:
            gpu.refused = DUPLICATE_UUID
            gpu.owner = owner
            owner.used_slots += gpu.used_slots
            owner.used_mem += gpu.used_mem
            owner.used_cores += gpu.used_cores
        change.nodes.update(gpu.node for _, gpu in ranked)


def _own(entry: tuple[Rank, Gpu], group: list[tuple[Rank, Gpu]]) -> tuple[int, int, int]:
    """What the pods on ``entry``'s node hold on its GPU: an owner's usage less its duplicates'."""
    gpu = entry[1]
    slots, mem, cores = gpu.used_slots, gpu.used_mem, gpu.used_cores
    for _, other in group:
        if other.owner is gpu:
            slots, mem, cores = slots - other.used_slots, mem - other.used_mem, cores - other.used_cores
    return slots, mem, cores
