"""This replica's role on its own pod, so that a Service can send kube-scheduler to the leader alone.

With replicas electing a leader, a request that reaches a follower costs a second hop: the
follower forwards it, or answers a 307 that kube-scheduler follows (docs/extender.md#replicas).
kube-proxy balances kube-scheduler's connections over every ready endpoint of the Service, and Go's
client, keeping two idle connections per host, opens new ones under load, so most requests land
on a follower whatever the balancing. ``RoleLabel`` keeps the label ``hami-py.io/extender-role`` on
this replica's pod at ``leader`` while it decides (it holds the Lease and its model holds the
cluster) and at ``follower`` otherwise. The chart's Service selects ``leader``: kube-scheduler's
requests reach the replica that decides, and the forward or redirect is left for the moments a
leader changes (the old one's label is taken off as soon as the API lets it).

The label is checked every ``interval_s`` (the election's retry period) and written only when it
changes: one pod patch per change of leader. A write that fails is tried again at the next check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, Literal

from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import KubeApi
from hamipy.kube.errors import KubeError
from hamipy.kube.resources import patch_pod
from hamipy.protocol import keys

__all__ = ["LEADER", "RoleLabel"]

Role = Literal["leader", "follower"]
LEADER: Final[Role] = "leader"
FOLLOWER: Final[Role] = "follower"


class RoleLabel:
    """Keeps ``hami-py.io/extender-role`` on the pod ``namespace/name`` at this replica's role."""

    def __init__(
        self,
        *,
        api: KubeApi,
        namespace: str,
        name: str,
        deciding: Callable[[], bool],
        telemetry: Telemetry,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.deciding = deciding
        self.telemetry = telemetry
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.applied: Role | None = None
        """The role the pod's label last took from this replica (None: not written yet)."""

    async def sync(self) -> None:
        """Write the role if the label does not hold it yet; a failure is logged and left for the
        next call."""
        role = LEADER if self.deciding() else FOLLOWER
        if role == self.applied:
            return
        body = {"metadata": {"labels": {keys.EXTENDER_ROLE: role}}}
        try:
            await patch_pod(self.api, self.namespace, self.name, body, timeout_s=self.timeout_s)
        except KubeError as exc:
            self.telemetry.metrics.role_labels.labels(result="failed").inc()
            self.telemetry.logger.warning(
                "could not label this replica's pod with its role; retrying",
                namespace=self.namespace,
                pod=self.name,
                role=role,
                error=str(exc),
            )
            return
        self.applied = role
        self.telemetry.metrics.role_labels.labels(result=role).inc()
        self.telemetry.logger.info(
            "labelled this replica's pod", namespace=self.namespace, pod=self.name, role=role
        )

    async def run(self) -> None:
        """``sync`` every ``interval_s``, until cancelled (a supervised task)."""
        while True:
            await self.sync()
            await asyncio.sleep(self.interval_s)
