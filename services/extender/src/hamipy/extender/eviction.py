"""Carrying out a preemption the filter planned (``hamipy.extender.preemption``), as kube-scheduler
carries out its own (``prepareCandidate``): for each victim, the ``DisruptionTarget`` condition
(reason ``PreemptionByScheduler``) on its status, then a delete guarded by its UID (a new pod of the
same name is never touched), with the victim's own grace period; an Event on each victim
(``Preempted``, naming the preemptor) and one on the preemptor (``Preempting``, naming the victims);
then the preemptor's ``status.nominatedNodeName``, as kube-scheduler sets it.

Runs in the background (the filter answers at once); the preemptor's GPUs are already held by the
filter's reservation, so nothing else takes what the victims free. If a call fails, the preemption
is dropped (its reservation released): the pod's next filter plans again.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from hamipy.extender.model import ClusterModel, PodUid
from hamipy.extender.preemption import PREEMPTING, Plan, Preemptor
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeApi
from hamipy.kube.errors import Conflict, KubeError, NotFound
from hamipy.kube.events import EventRecorder
from hamipy.kube.resources import pod_path

__all__ = ["PREEMPTED", "Evictor"]

PREEMPTED: Final = "Preempted"
"""kube-scheduler's reason for the Event on a victim."""


class Evictor:
    """Evicts the victims of planned preemptions, one background task per preemption."""

    def __init__(
        self,
        *,
        api: KubeApi,
        model: ClusterModel,
        events: EventRecorder,
        telemetry: Telemetry,
        scheduler_name: str,
        timeout_s: float,
    ) -> None:
        self.api = api
        self.model = model
        self.events = events
        self.telemetry = telemetry
        self.scheduler_name = scheduler_name
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, preemptor: Preemptor, plan: Plan) -> None:
        task = asyncio.get_running_loop().create_task(self._evict(preemptor, plan))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def idle(self) -> None:
        """Wait until every preemption started so far is carried out (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.idle()

    async def _evict(self, preemptor: Preemptor, plan: Plan) -> None:
        who = f"{preemptor.namespace}/{preemptor.name}"
        log = self.telemetry.logger.bind(namespace=preemptor.namespace, pod=preemptor.name, node=plan.node)
        try:
            for victim in plan.victims:
                await self._evict_one(victim.namespace, victim.name, victim.uid)
                self.events.emit(
                    {"kind": "Pod", "namespace": victim.namespace, "name": victim.name, "uid": victim.uid},
                    PREEMPTED,
                    f"Preempted by pod {who} (priority {preemptor.priority}) on node {plan.node}: "
                    "it needed this pod's GPU memory or cores",
                )
            await self.api.request(
                "PATCH",
                pod_path(preemptor.namespace, preemptor.name) + "/status",
                body={"metadata": {"uid": preemptor.uid}, "status": {"nominatedNodeName": plan.node}},
                content_type=MERGE_PATCH,
                timeout_s=self.timeout_s,
            )
        except KubeError as exc:
            log.warning("preemption failed; the pod's next filter plans again", error=str(exc))
            self.model.nominations.pop(preemptor.uid, None)
            self.model.release(preemptor.uid)
            self.telemetry.metrics.decisions.labels(verb="preempt", result="error", reason="APIError").inc()
            return
        victims = ", ".join(f"{v.namespace}/{v.name}" for v in plan.victims)
        log.info("preempted", victims=victims)
        self.telemetry.metrics.decisions.labels(verb="preempt", result="preempted", reason=PREEMPTING).inc()
        self.events.emit(
            {"kind": "Pod", "namespace": preemptor.namespace, "name": preemptor.name, "uid": preemptor.uid},
            PREEMPTING,
            f"preempted {victims} (lower priority) on node {plan.node} to free GPU memory and cores "
            "for this pod; it is placed there once they have stopped",
        )

    async def _evict_one(self, namespace: str, name: str, uid: PodUid) -> None:
        path = pod_path(namespace, name)
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "message": f"{self.scheduler_name}: preempting to accommodate a higher priority pod",
        }
        with contextlib.suppress(NotFound, Conflict):  # gone already, or another pod by now
            await self.api.request(
                "PATCH",
                path + "/status",
                body={"metadata": {"uid": uid}, "status": {"conditions": [condition]}},
                content_type=STRATEGIC_MERGE_PATCH,
                timeout_s=self.timeout_s,
            )
            await self.api.request(
                "DELETE",
                path,
                body={"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}},
                timeout_s=self.timeout_s,
            )
