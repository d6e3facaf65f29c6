"""Whether this extender may decide and whether it is ready (``Health``): what ``/readyz`` and the
decision routes consult (``hamipy.extender.routes``)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from hamipy.extender.model import ClusterModel
from hamipy.extender.watching import Resource
from hamipy.kube.informer import Informer
from hamipy.serving.supervision import Supervisor

__all__ = ["Health"]


class Health:
    """Whether this extender may decide and whether it is ready: what ``/readyz`` and the decision
    routes consult. ``informers`` by resource (none when running without the cluster: then the
    model counts as listed once it was fed both resources)."""

    def __init__(
        self,
        *,
        model: ClusterModel,
        supervisor: Supervisor,
        informers: Mapping[Resource, Informer] | None = None,
    ) -> None:
        self.model = model
        self.supervisor = supervisor
        self.informers = dict(informers or {})
        self.stopping = asyncio.Event()
        self.watching = True
        """False while a cold standby has not led yet (its informers are not started)."""

    def broken(self) -> str | None:
        """Why decisions are refused (a background task died: the model may be stale), or None."""
        return self.supervisor.failure

    def synced(self) -> bool:
        """Whether the model holds the cluster: every informer has listed (and, without informers,
        the model was fed nodes and pods)."""
        return all(i.listed.is_set() for i in self.informers.values()) and self.model.synced

    def not_ready(self) -> str | None:
        """Why ``/readyz`` fails, or None when ready."""
        if self.stopping.is_set():
            return "stopping"
        failure = self.broken()
        if failure is not None:
            return failure
        if not self.watching:
            return None  # a cold standby passes requests to the leader; it lists once it leads
        waiting = [name for name, informer in self.informers.items() if not informer.listed.is_set()]
        if waiting or not self.model.synced:
            return f"model not synced yet (listing {' and '.join(waiting or ['nodes', 'pods'])})"
        return None
