"""The priority feedback rule: what the monitor writes into ``recent_kernel`` and
``utilization_switch`` of each region (pure).

HAMi's contract between the monitor and the interposer (HAMi-core), followed here:

- The interposer sets ``recent_kernel = 2`` when the container launches a kernel, blocks kernel
  launches while ``recent_kernel < 0``, and enforces the SM (core) limit only while
  ``utilization_switch == 1`` (policy ``default``; ``force`` always limits, ``disable`` never).
- Each pass, the monitor counts a kernel as aging: every container with ``recent_kernel > 0`` gets
  it decremented, and a container whose value is still above 0 after that is *active* on each of
  its GPUs, at its ``priority`` (``CUDA_TASK_PRIORITY``: a lower number is a higher priority; HAMi
  uses 0 high and 1 low).
- **Blocking.** A container that shares a GPU with an active container of higher priority gets
  ``recent_kernel = -1`` (its launches wait); when there is none any more it gets 0 again.
- **Compute limit while shared.** A container gets ``utilization_switch = 1`` when one of its GPUs
  has an active container of higher priority or more than one active container of its own priority
  (itself included), and 0 otherwise: a slice may use the whole GPU while nobody else is computing
  on it, as upstream (``cmd/vGPUmonitor/feedback.go``).

Differences from upstream, neither of which changes the contract: every GPU of a container is
considered (upstream decides blocking by the first GPU it finds in its table), and any priority
value is ordered numerically (upstream indexes a two-entry table and would fail on another value).
A device with an empty UUID (a region still being filled) is not counted. A ``recent_kernel`` above
2 counts as 2 (its next value is 1), and any value below 0 as blocked: the monitor writes with
``pwrite``, which is not guaranteed to be one 4-byte store, so a write racing the interposer's
compare-and-swap could leave a mixed value; this bounds its effect to one pass.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from typing import Final, Generic, TypeVar

__all__ = ["BLOCKED", "KERNEL_MARK", "FeedbackInput", "FeedbackWrite", "feedback"]

K = TypeVar("K", bound=Hashable)

KERNEL_MARK: Final = 2
"""What the interposer writes into ``recent_kernel`` at a kernel launch."""
BLOCKED: Final = -1


@dataclasses.dataclass(frozen=True, slots=True)
class FeedbackInput(Generic[K]):
    """One container's region as read: its key (the file), the two feedback fields, its priority
    and the UUIDs of its GPUs."""

    key: K
    priority: int
    recent_kernel: int
    utilization_switch: int
    devices: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FeedbackWrite(Generic[K]):
    """A value to write; only changes are returned."""

    key: K
    field: str
    value: int


def feedback(containers: Sequence[FeedbackInput[K]]) -> list[FeedbackWrite[K]]:
    """The writes of one feedback pass over all regions of a node (module docstring)."""
    writes: list[FeedbackWrite[K]] = []
    recent: dict[K, int] = {}
    # active[uuid][priority]: containers that launched a kernel recently, per GPU and priority.
    active: defaultdict[str, Counter[int]] = defaultdict(Counter)
    for c in containers:
        # Above the mark is no value the interposer writes (a torn or foreign write): read it as a
        # fresh mark, so that it ages out in two passes instead of keeping the GPU "busy" for ever.
        value = min(c.recent_kernel, KERNEL_MARK)
        if value > 0:
            value -= 1
            writes.append(FeedbackWrite(c.key, "recent_kernel", value))
            if value > 0:
                for uuid in set(filter(None, c.devices)):
                    active[uuid][c.priority] += 1
        recent[c.key] = value

    for c in containers:
        blocked = shared = False
        for uuid in filter(None, c.devices):
            counts = active.get(uuid)
            if not counts:
                continue
            higher = any(n > 0 for p, n in counts.items() if p < c.priority)
            blocked = blocked or higher
            shared = shared or higher or counts[c.priority] > 1
        value = recent[c.key]
        if blocked and value >= 0:
            writes.append(FeedbackWrite(c.key, "recent_kernel", BLOCKED))
        elif not blocked and value < 0:
            writes.append(FeedbackWrite(c.key, "recent_kernel", 0))
        switch = 1 if shared else 0
        if c.utilization_switch != switch:
            writes.append(FeedbackWrite(c.key, "utilization_switch", switch))
    return _last_per_field(writes)


def _last_per_field(writes: list[FeedbackWrite[K]]) -> list[FeedbackWrite[K]]:
    """One write per (key, field): the last one decided (a decrement then a block is one write)."""
    last: dict[tuple[K, str], FeedbackWrite[K]] = {}
    for w in writes:
        last.pop((w.key, w.field), None)
        last[(w.key, w.field)] = w
    return list(last.values())
