"""What keeps the model current (the I/O feeding ``model``): an informer per resource, and the
handshake stamping loop.

Nodes and Pods are each listed and watched by a ``hamipy.kube.informer.Informer`` (paged list,
watch with bookmarks, 410 re-list, jittered backoff on API errors; any other error ends it, for the
server's supervisor to report). ``ModelFeed`` is the small handler between an informer and the
model: a list replaces the model's view of that resource (so what was deleted while no watch was
open is forgotten) and each change applies one object. The informers keep no cache of their own
(``keep=False``): the model is the cache.

ResourceQuotas feed the namespaces' GPU limits (``hamipy.extender.quota``) and
PodDisruptionBudgets what preemption respects (``hamipy.extender.disruption_budgets``; not watched
with ``--no-preemption``).

Pods are watched in all namespaces: any bound pod may hold GPUs (bound by HAMi, by another replica,
or before a restart), and the allocation annotation is the only record of it; and the pods not bound
yet are the ones a filter may reserve for (``ClusterModel.pending``).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, Literal

from hamipy.extender.model import ClusterModel, Problem
from hamipy.extender.quota import QuotaProblem
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import KubeApi
from hamipy.kube.errors import KubeError
from hamipy.kube.events import EventRecorder
from hamipy.kube.informer import ChangeKind, Informer, InformerSettings, RestartCause
from hamipy.kube.resources import node_path, patch_node_annotations, pod_path
from hamipy.protocol import keys
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_handshake import needs_request, parse_handshake, requesting

__all__ = [
    "GPU_REFUSED",
    "RESOURCES",
    "ModelFeed",
    "Resource",
    "informer_settings",
    "model_informers",
    "report_problems",
    "stamp_handshakes",
    "stamp_once",
]

Resource = Literal["nodes", "pods", "resourcequotas", "poddisruptionbudgets"]
RESOURCES: Final[tuple[Resource, ...]] = ("nodes", "pods", "resourcequotas", "poddisruptionbudgets")
_PATHS: Final[dict[Resource, str]] = {
    "nodes": node_path(),
    "pods": pod_path(),
    "resourcequotas": "/api/v1/resourcequotas",
    "poddisruptionbudgets": "/apis/policy/v1/poddisruptionbudgets",
}


GPU_REFUSED: Final = "GPURefused"
"""The Event on a node whose register entry for a GPU is refused (``hamipy.extender.gpu_claims``)."""


def report_problems(problems: list[Problem], telemetry: Telemetry, events: EventRecorder) -> None:
    """Log, count and post an Event for each malformed object or refused GPU."""
    for p in problems:
        involved = {"kind": p.kind, "name": p.name, "uid": p.uid}
        if p.namespace:
            involved["namespace"] = p.namespace
        if p.refused:
            telemetry.logger.error("GPU refused; it is not offered", node=p.name, uid=p.uid, error=p.reason)
            events.emit(involved, GPU_REFUSED, p.reason, warning=True)
            continue
        telemetry.metrics.malformed.labels(kind=p.kind, field=p.annotation).inc()
        telemetry.logger.error(
            "malformed annotation; its capacity is not offered",
            kind=p.kind,
            namespace=p.namespace,
            name=p.name,
            uid=p.uid,
            field=p.field,
            error=p.reason,
        )
        events.emit(involved, "MalformedAnnotation", f"{p.reason}; its GPUs are not scheduled", warning=True)


class ModelFeed:
    """An informer's handler: one resource of the model, replaced on each list, changed per event.
    ``on_change`` (optional) is called after each."""

    def __init__(
        self,
        resource: Resource,
        *,
        model: ClusterModel,
        telemetry: Telemetry,
        events: EventRecorder,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.resource = resource
        self.model = model
        self.telemetry = telemetry
        self.events = events
        self.on_change = on_change

    def listed(self, objects: list[dict[str, Any]]) -> None:
        if self.resource == "poddisruptionbudgets":
            self.model.budgets.replace(objects)
            return
        if self.resource == "resourcequotas":
            quotas = self.model.quotas
            before = tuple(quotas.all_limits())
            self._quota_problems(quotas.replace(objects))
            if tuple(quotas.all_limits()) != before:
                self.model.quotas_changed()
            self._changed()
            return
        if self.resource == "nodes":
            problems = self.model.replace_nodes(objects)
        else:
            problems = self.model.replace_pods(objects)
        report_problems(problems, self.telemetry, self.events)
        # The model is a large, long-lived heap (tens of thousands of pods): keep the cyclic GC from
        # walking it on every full collection, which would pause filters for the whole walk.
        gc.collect()
        gc.freeze()
        self._changed()

    def changed(self, kind: ChangeKind, obj: dict[str, Any]) -> None:
        if self.resource == "poddisruptionbudgets":
            self.model.budgets.apply(kind, obj)
            return
        if self.resource == "resourcequotas":
            # Most ResourceQuota events are its controller's status.used updates: only a change of
            # the GPU limits themselves is news.
            quotas = self.model.quotas
            namespace = str((obj.get("metadata") or {}).get("namespace", ""))
            before = quotas.limits(namespace)
            self._quota_problems(quotas.apply(kind, obj))
            if quotas.limits(namespace) != before:
                self.model.quotas_changed()
            self._changed()
            return
        if self.resource == "nodes":
            problems = self.model.apply_node(kind, obj)
        else:
            problems = self.model.apply_pod(kind, obj)
        report_problems(problems, self.telemetry, self.events)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _quota_problems(self, problems: list[QuotaProblem]) -> None:
        """A GPU limit that cannot be read: logged, counted, and an Event on its ResourceQuota."""
        self.model.generation += 1
        for p in problems:
            self.telemetry.metrics.malformed.labels(kind="ResourceQuota", field="spec.hard").inc()
            self.telemetry.logger.error(
                "malformed GPU quota; that limit is not enforced",
                namespace=p.namespace,
                name=p.name,
                error=p.reason,
            )
            involved = {"kind": "ResourceQuota", "namespace": p.namespace, "name": p.name, "uid": p.uid}
            self.events.emit(involved, "MalformedQuota", p.reason, warning=True)


def informer_settings(settings: ExtenderSettings) -> InformerSettings:
    """The informers' timeouts from the extender's (backoff and paging as the library has them)."""
    return InformerSettings(
        list_timeout_s=settings.api_timeout_s * 3,
        watch_timeout_s=int(settings.watch_timeout_s),
        inactivity_s=settings.watch_inactivity_s,
    )


def model_informers(
    api: KubeApi,
    *,
    model: ClusterModel,
    settings: ExtenderSettings,
    telemetry: Telemetry,
    events: EventRecorder,
    on_change: Mapping[Resource, Callable[[], None]] | None = None,
) -> dict[Resource, Informer]:
    """An informer per resource, each feeding ``model`` and counting its restarts in
    ``hamipy_extender_watch_restarts_total{resource,cause}``, and calling ``on_change[resource]``
    after each list and event it applied; not started (``run`` them)."""
    out: dict[Resource, Informer] = {}
    for resource in RESOURCES:
        if resource == "poddisruptionbudgets" and not settings.preemption:
            continue  # only preemption reads them

        def restarted(cause: RestartCause, resource: Resource = resource) -> None:
            telemetry.metrics.watch_restarts.labels(resource=resource, cause=cause).inc()

        watch = Informer(
            api,
            _PATHS[resource],
            logger=telemetry.logger,
            settings=informer_settings(settings),
            keep=False,
            on_restart=restarted,
        )
        watch.subscribe(
            ModelFeed(
                resource,
                model=model,
                telemetry=telemetry,
                events=events,
                on_change=(on_change or {}).get(resource),
            )
        )
        out[resource] = watch
    return out


async def stamp_handshakes(
    *,
    api: KubeApi,
    model: ClusterModel,
    settings: ExtenderSettings,
    telemetry: Telemetry,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> None:
    """Every ``handshake_interval_s``, write ``Requesting_<now>`` on registered nodes whose
    handshake is not a pending request (HAMi's scheduler does the same); a device plugin answers by
    registering again. Never on the filter path."""
    while True:
        await asyncio.sleep(settings.handshake_interval_s)
        await stamp_once(api=api, model=model, settings=settings, telemetry=telemetry, now=now())


async def stamp_once(
    *, api: KubeApi, model: ClusterModel, settings: ExtenderSettings, telemetry: Telemetry, now: datetime
) -> int:
    """One pass of ``stamp_handshakes``; returns how many nodes were stamped."""
    stamped = 0
    for node in list(model.nodes.values()):
        if not node.registered:
            continue
        try:
            handshake = parse_handshake(node.handshake) if node.handshake else None
        except ProtocolError:
            handshake = None
        if not needs_request(handshake):
            continue
        try:
            await patch_node_annotations(
                api, node.name, {keys.NODE_HANDSHAKE: requesting(now)}, timeout_s=settings.api_timeout_s
            )
            stamped += 1
        except KubeError as exc:
            telemetry.logger.warning("handshake not stamped", node=node.name, error=str(exc))
    return stamped
