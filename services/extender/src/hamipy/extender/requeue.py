"""Tell kube-scheduler when GPUs free up for pods the extender refused.

A pod the extender's filter refused on every node waits in kube-scheduler's unschedulable pool
until some cluster event moves it back (kube-scheduler files an extender's refusal under its
``Extender`` pseudo-plugin, which any event of any kind wakes), or until the pool's 5-minute flush.
Most of what frees GPUs is such an event (a pod deleted or finished), but kube-scheduler and the
extender see it through separate watches: when kube-scheduler's copy arrives first, it retries the
pod at once, the extender's model still holds the departed pod's GPUs and refuses again, and
nothing wakes the pod for 5 minutes. Other things that free GPUs are invisible to kube-scheduler
altogether: a reservation or a preemption hold that lapses, a ResourceQuota's GPU limit raised.

``Requeuer`` closes that gap. The filter records each pod it refuses (``refused``); the model calls
``freed`` once it has applied a change that may make room (``ClusterModel.on_freed``). If a refused
pod is still pending, one merge patch of the annotation ``hami-py.io/requeue`` on a node (the one
where GPUs freed, or any node the model knows) gives kube-scheduler a node event, and it retries
every pod the extender refused against the model as it now is. Patches are at most one per
``interval_s``, however many pods are waiting or GPUs free meanwhile; nothing is written while no
refused pod waits, so a cluster with room never pays for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Final

from hamipy.extender.model import ClusterModel, NodeName, PodUid
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import KubeApi
from hamipy.kube.errors import KubeError
from hamipy.kube.resources import patch_node_annotations
from hamipy.protocol import keys

__all__ = ["REFUSAL_TTL_S", "Requeuer"]

REFUSAL_TTL_S: Final = 600.0
"""A refusal older than this is forgotten: kube-scheduler has flushed the pod back into its queue
since (after 5 minutes at most) and, had it been refused again, it would be on record again."""


class Requeuer:
    """The refused pods still waiting, and the loop (``run``) that writes the nudge."""

    def __init__(
        self,
        *,
        api: KubeApi,
        model: ClusterModel,
        telemetry: Telemetry,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.model = model
        self.telemetry = telemetry
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._refused: dict[PodUid, float] = {}
        self._node: NodeName | None = None
        self._wake = asyncio.Event()

    def refused(self, uid: PodUid) -> None:
        """The filter found no node for this pod."""
        self._refused[uid] = self.clock()

    def freed(self, node: NodeName | None) -> None:
        """The model may have room it had not (on ``node``, or anywhere for None)."""
        if not self._refused:
            return
        if node is not None:
            self._node = node
        self._wake.set()

    def waiting(self) -> int:
        """How many refused pods still wait (pending in the model, refused within the TTL)."""
        oldest = self.clock() - REFUSAL_TTL_S
        pending = self.model.pending
        for uid, at in list(self._refused.items()):
            if at < oldest or uid not in pending:
                del self._refused[uid]
        return len(self._refused)

    def target(self) -> NodeName | None:
        """The node to annotate: where GPUs freed if the model still has it, else any it has."""
        if self._node is not None and self._node in self.model.nodes:
            return self._node
        return next(iter(self.model.nodes), None)

    async def nudge(self) -> bool:
        """Write the annotation if GPUs freed since the last nudge and a refused pod still waits;
        whether it was written."""
        if not self._wake.is_set():
            return False
        self._wake.clear()
        node = self.target() if self.waiting() else None
        self._node = None
        if node is None:
            return False
        stamp = datetime.now(UTC).isoformat(timespec="microseconds")
        metrics = self.telemetry.metrics
        try:
            await patch_node_annotations(self.api, node, {keys.REQUEUE: stamp}, timeout_s=self.timeout_s)
        except KubeError as exc:
            metrics.requeue_nudges.labels(result="failed").inc()
            self.telemetry.logger.warning(
                "refused pods not requeued; kube-scheduler retries them at its next cluster event",
                node=node,
                waiting=len(self._refused),
                error=str(exc),
            )
            return False
        metrics.requeue_nudges.labels(result="sent").inc()
        self.telemetry.logger.debug("refused pods requeued", node=node, waiting=len(self._refused))
        return True

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            if await self.nudge():
                # What frees meanwhile rides on the next nudge: at most one write per interval.
                await asyncio.sleep(self.interval_s)
