"""Why each node does not fit a pod, remembered per pod ask and node state (for filters that fit
nowhere).

A filter that fits nowhere explains every node it was sent: a full fit per node, tens of
milliseconds of the event loop at 1,000 nodes (``tests/bench/bench_extender.py``, "no node
fits"). A pod that fits nowhere is filtered again and again (kube-scheduler retries it
on every cluster event that might help, and a backlog of pods waiting for GPUs is the normal state
of a busy cluster), usually with the same ask against nodes most of which have not changed since.
So each node's explanation is kept with the node state it was made from: the ``NodeState`` object
(a re-registered node is a new one) and its ``version``, which the model bumps whenever the node's
usage changes (``ClusterModel._summarize``). An explanation is reused only while both are the
same, so it is always the one a fit would give now.

Bounded: the last ``max_asks`` asks, each with at most twice as many nodes as the model has.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final, NamedTuple

from hamipy.extender.fitting import NodeReasons, PodAsk
from hamipy.extender.model import NodeState

__all__ = ["MAX_ASKS", "Explained", "Explanations"]

MAX_ASKS: Final = 8
"""Asks remembered (each up to a few hundred kB at 1,000 nodes): a backlog is mostly a few shapes."""


class Explained(NamedTuple):
    """A node's explanation for one ask, as of ``state`` at ``version``; ``reasons`` None when the
    pod fits there after all."""

    state: NodeState
    version: int
    reasons: NodeReasons | None
    possible: bool
    """Whether the pod could fit the node if it were empty (else its reasons are unresolvable)."""


class Explanations:
    """Per pod ask (``PodAsk``, equal for pods that ask the same), each node's ``Explained``."""

    __slots__ = ("_by_ask", "max_asks")

    def __init__(self, max_asks: int = MAX_ASKS) -> None:
        self.max_asks = max_asks
        self._by_ask: OrderedDict[PodAsk, dict[str, Explained]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_ask)

    def of(self, ask: PodAsk, *, nodes: int) -> dict[str, Explained]:
        """The explanations kept for ``ask`` (the most recently used now), to read and add to; a
        fresh one when it had more than twice ``nodes`` entries (nodes since deleted)."""
        known = self._by_ask.pop(ask, None)
        if known is None or len(known) > 2 * nodes:
            known = {}
        while len(self._by_ask) >= self.max_asks:
            self._by_ask.popitem(last=False)
        self._by_ask[ask] = known
        return known
