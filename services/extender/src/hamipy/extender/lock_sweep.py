"""Node locks nobody else will free: retried releases and stuck locks (docs/extender.md#stuck-locks).

Two kinds of lock outlive their use after an API fault or a crash:

- **ours, not released**: a bind released its lock while the API server was down or busy (the
  release gave up). ``owe`` records it; the sweep retries every ``lock_sweep_interval_s`` until the
  lock is gone or no longer names that pod, so it is freed within one interval of the API answering
  again instead of at its 5-minute expiry. A node this replica is binding on is skipped that round,
  and a node this replica locks again is forgotten (the new lock is the bind's own);
- **anyone's, stuck**: a lock held longer than a bind waits (``bind_timeout_s``) whose owner pod is
  gone, finished or already served, or bound where no device plugin of this node will serve it
  (on a node our device plugin serves, where locks last only for the bind, its binder died before
  releasing it; or it is bound to another node): the rule a bind breaks it by. Only the replica that decides
  sweeps these. Meanwhile the filter passes such a node over (``LockRule``), so no pod waits for it.

Every removal is the resourceVersion-guarded ``release_node_lock``: a lock that names another pod by
then is never touched.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Final, Literal

from hamipy.extender.model import ClusterModel, NodeName, now_epoch
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import KubeApi
from hamipy.kube.errors import KubeError
from hamipy.kube.node_lock import release_node_lock

__all__ = ["LockSweeper", "LockVerdict"]

BreakReason = Literal["malformed", "expired", "owner-gone", "owner-done", "owner-bound"]
"""Why a node lock may be broken (the ``reason`` label of ``hamipy_extender_lock_breaks``)."""

_STUCK_REASONS: Final[frozenset[BreakReason]] = frozenset({"owner-gone", "owner-done", "owner-bound"})

Owner = tuple[str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class LockVerdict:
    """What a bind may do with a node lock it found: ``mine`` (it names the pod being bound),
    ``held`` (wait for it), or a reason to break it; and who holds it, as a user reads it."""

    kind: Literal["mine", "held"] | BreakReason
    holder: str

    @property
    def breaks(self) -> bool:
        return self.kind not in ("mine", "held")


JudgeLock = Callable[[str, str, str, NodeName], Awaitable[LockVerdict]]
"""``Binder.breakable``: the verdict on (lock value, namespace, name, node)."""


class LockSweeper:
    """Frees the node locks described in the module docstring; ``run`` is a background task."""

    def __init__(
        self,
        *,
        api: KubeApi,
        model: ClusterModel,
        settings: ExtenderSettings,
        telemetry: Telemetry,
        busy: Callable[[NodeName], bool],
        breakable: JudgeLock,
        deciding: Callable[[], bool] = lambda: True,
    ) -> None:
        self.api = api
        self.model = model
        self.settings = settings
        self.telemetry = telemetry
        self.busy = busy
        """Whether this replica is binding on the node now (its lock may be that bind's)."""
        self.breakable = breakable
        self.deciding = deciding
        self.owed: dict[NodeName, Owner] = {}
        """Releases that failed: node -> the pod our lock there names."""

    def owe(self, node: NodeName, namespace: str, name: str) -> None:
        self.owed[node] = (namespace, name)
        self.telemetry.metrics.lock_releases_owed.set(len(self.owed))

    def forget(self, node: NodeName) -> None:
        if self.owed.pop(node, None) is not None:
            self.telemetry.metrics.lock_releases_owed.set(len(self.owed))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lock_sweep_interval_s)
            await self.sweep()

    async def sweep(self) -> None:
        """One round: owed releases, then (when deciding) stuck locks."""
        for node, owner in list(self.owed.items()):
            if not self.busy(node):
                await self._free(node, owner, reason="released-late")
        if self.deciding():
            await self._stuck()

    async def _stuck(self) -> None:
        now = now_epoch()
        after, expiry = self.settings.bind_timeout_s, self.settings.lock_expiry.total_seconds()
        for state in list(self.model.nodes.values()):
            lock, value = state.lock, state.lock_value
            if lock is None or value is None or lock.namespace is None or lock.name is None:
                continue  # no lock, or a legacy one naming no owner: it holds until it expires
            if state.name in self.owed or self.busy(state.name):
                continue
            if not state.lock_blocks(now, after_s=after, expiry_s=expiry, pod=("", "")):
                continue
            try:
                verdict = await self.breakable(value, "", "", state.name)
            except KubeError as exc:
                self.telemetry.logger.warning("node lock not checked", node=state.name, error=str(exc))
                continue
            if verdict.kind in _STUCK_REASONS:
                await self._free(state.name, (lock.namespace, lock.name), reason=verdict.kind)

    async def _free(self, node: NodeName, owner: Owner, *, reason: str) -> None:
        namespace, name = owner
        try:
            outcome = await release_node_lock(
                self.api, node, namespace=namespace, name=name, timeout_s=self.settings.api_timeout_s
            )
        except KubeError as exc:
            self.telemetry.logger.debug("node lock still not released", node=node, error=str(exc))
            return
        if outcome == "contended":
            return  # lost every write race this round: the next one tries again
        if node in self.owed and self.owed[node] == owner:
            self.forget(node)
        if outcome == "released":
            self.telemetry.metrics.lock_breaks.labels(reason=reason).inc()
            holder = f"{namespace}/{name}"
            self.telemetry.logger.info("node lock freed", node=node, holder=holder, reason=reason)
