"""A filter of a pod the pod watch has not delivered yet waits for it (``PodArrivals``).

kube-scheduler and the extender watch pods from the same API server, and kube-scheduler filters a
new pod as soon as its own watch delivers it. When the extender's watch is behind (up to 0.3 s in a
1,000-pod burst at 1,000 nodes: docs/benchmarks.md#placement-under-bursts), the filter names a pod
the model does not hold yet. A filter reserves only for a pod the watch holds (anyone who reaches
``/filter`` can name any pod: docs/extender.md#how-a-pod-is-placed), so that filter would reserve
nothing, and the filters after it would fit their pods as if it were not placed: under spread a
burst lands on the node that looks emptiest, under binpack on a node its bind then finds full.

So the filter waits while the watch is behind the pod it names, at most ``wait_s``. The pod sent
carries the ``resourceVersion`` kube-scheduler read it at; the watch has applied every change up to
the version it has reached (the informer's ``resource_version``: the API server sends a watch's
events in resourceVersion order). Once it reaches the pod's version, or holds the pod, the filter
goes on: with the pod held it reserves as usual; without (deleted meanwhile, bound, another
scheduler's) it is answered as any filter of a pod the watch does not hold. A pod sent without a
version, or a version that is not an integer on either side, waits for nothing: Kubernetes calls
resourceVersions opaque, but etcd's are integers that only grow, and the informer compares them so
already. A made-up body naming a version far ahead costs its own caller the wait, and reserves
nothing after it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

from hamipy.extender.telemetry import Metrics
from hamipy.protocol.kube_objects import ObjectMeta

__all__ = ["PodArrivals", "WaitResult"]

WaitResult = Literal["reached", "timeout"]
"""How a wait ended: the watch reached the pod's version or holds the pod, or ``wait_s`` passed."""


class PodArrivals:
    """Filters waiting for the pod watch; ``changed`` is told of every pod event and list applied.

    ``held(uid)``: whether the model holds the pod pending; ``reached()``: the resourceVersion the
    pod watch has reached. Both are read after the informer has applied an event and advanced its
    version (a waiter resumes a loop turn after ``changed``)."""

    def __init__(
        self,
        *,
        held: Callable[[str], bool],
        reached: Callable[[], str],
        wait_s: float,
        metrics: Metrics,
    ) -> None:
        self._held = held
        self._reached = reached
        self.wait_s = wait_s
        self._metrics = metrics
        self._changed: asyncio.Event | None = None

    def changed(self) -> None:
        """The pod watch applied an event or a list: waiting filters look again."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _behind(self, uid: str, version: str) -> bool:
        reached = self._reached()
        return not self._held(uid) and version.isdigit() and reached.isdigit() and int(version) > int(reached)

    async def wait(self, meta: ObjectMeta) -> WaitResult | None:
        """Return once the pod watch has reached the pod of ExtenderArgs' ``Pod.metadata`` (at once
        when it has, or when it names no version), or after ``wait_s``; how the wait ended, None
        when there was none."""
        uid, version = meta.uid, meta.resource_version
        if uid is None or version is None or self.wait_s <= 0 or not self._behind(uid, version):
            return None
        named = (uid, version)
        started = time.perf_counter()
        result: WaitResult = "reached"
        self._metrics.watch_waiting.inc()
        try:
            async with asyncio.timeout(self.wait_s):
                while self._behind(*named):
                    if self._changed is None:
                        self._changed = asyncio.Event()
                    await self._changed.wait()
        except TimeoutError:
            result = "timeout"
        finally:
            self._metrics.watch_waiting.dec()
        self._metrics.watch_waits.labels(result=result).observe(time.perf_counter() - started)
        return result
