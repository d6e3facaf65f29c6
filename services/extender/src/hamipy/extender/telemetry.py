"""Logs, metrics and traces of the extender, with no module-level state
(docs/design.md#8-observable-by-default).

Metrics live on a per-instance ``CollectorRegistry`` (several extenders in one test process do not
share counters):

- HAMi's scheduler metrics (docs/wire-format.md#metrics, same names and labels), computed from the model
  at scrape time: nothing is updated on the filter path. The per-GPU and per-container gauges are
  written as text by ``gpu_gauges`` (tens of thousands of samples, too many for prometheus_client's
  collectors on the event loop: ``hamipy.telemetry.exposition``); the quota gauges
  (``hami_resource_quota_used``, ``hami_resource_quota_limit``) come from ``QuotaCollector``.
- ``hamipy_extender_filter_duration_seconds`` / ``..._bind_duration_seconds`` (by result),
  ``hamipy_extender_decisions`` (verb, result, reason; ``unavailable``/``BackgroundTaskDied`` for
  a decision refused because a background task died), ``hamipy_extender_malformed_annotations``
  (kind, field), ``hamipy_extender_events_dropped``, ``hamipy_extender_watch_restarts`` (resource,
  cause), ``hamipy_extender_lock_waits`` / ``..._lock_breaks`` (reason) / ``..._lock_releases_owed``,
  ``..._bind_paths`` (path: model or locked), ``..._bind_races``, ``..._forwarded`` (verb, result),
  ``..._leader``, ``..._pods_held`` (source), ``..._gpus_refused`` (reason),
  ``..._watch_wait_seconds`` (result) and ``..._watch_waiting``: filters that waited for the pod
  watch to deliver their pod (``hamipy.extender.pod_arrivals``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from hamipy.extender.gpu_claims import DUPLICATE_UUID, ZERO_MEMORY
from hamipy.extender.model import ClusterModel, Source
from hamipy.serving.http_metrics import HttpConnectionsCollector
from hamipy.telemetry.exposition import GaugeText, label_text
from hamipy.telemetry.gc_pauses import GcPauses
from hamipy.telemetry.service import ServiceTelemetry

__all__ = ["SERVICE_NAME", "Metrics", "QuotaCollector", "Telemetry", "gpu_gauges"]

SERVICE_NAME: Final = "hamipy-extender"
_MIB: Final = 1024 * 1024
# Filter is CPU work of well under a millisecond to a few; bind waits on the API and on node locks.
_FILTER_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
_BIND_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A filter waits for the pod watch for milliseconds behind a burst, seconds when the watch is stuck.
_WATCH_WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


ROWS_PER_STEP: Final = 500
"""GPUs or containers rendered between two yields to the event loop: a filter that arrives
mid-scrape waits one step, not the whole render (docs/benchmarks.md#metrics-at-1000-nodes)."""


_LINES_PER_CHUNK: Final = 4000
"""Lines of exposition text joined and encoded in one step (about 500 kB, well under a millisecond)."""


async def gpu_gauges(model: ClusterModel, *, rows_per_step: int = ROWS_PER_STEP) -> list[bytes]:
    """HAMi's per-GPU and per-container gauges, read from the model when Prometheus scrapes, as
    exposition text in chunks of at most ``_LINES_PER_CHUNK`` lines (``hamipy.telemetry.exposition``:
    at 1,000 nodes these are 76,000 samples, 10 MB).

    Rendered on the event loop, which owns the model, in steps: the nodes and contributions are
    listed first (the loop may add and remove them between steps) and each GPU's seven values are
    read in one step (they agree with one another; a scrape as a whole is not one instant, as with
    any exporter)."""
    families = (
        mem_limit := GaugeText("hami_gpu_memory_limit_bytes", "Device memory limit for a certain GPU"),
        core_limit := GaugeText("hami_gpu_core_limit_ratio", "Device core limit for a certain GPU"),
        mem_alloc := GaugeText(
            "hami_gpu_memory_allocated_bytes", "Device memory allocated for a certain GPU"
        ),
        shared := GaugeText("hami_gpu_shared_count", "Number of containers sharing this GPU"),
        core_alloc := GaugeText(
            "hami_gpu_core_allocated_ratio", "Device cores allocated for a certain GPU (0-100)"
        ),
        overview := GaugeText(
            "hami_node_gpu_overview", "GPU overview on a certain node: memory allocated in bytes"
        ),
        mem_ratio := GaugeText(
            "hami_node_gpu_memory_allocated_ratio", "GPU memory allocated ratio (0-1) on a certain GPU"
        ),
        vmem := GaugeText("hami_vgpu_memory_allocated_bytes", "vGPU memory allocated to a container"),
        vcore := GaugeText("hami_vgpu_core_allocated_ratio", "vGPU cores allocated to a container"),
    )
    nodes, contributions = list(model.nodes.values()), list(model.contributions.values())
    rows = 0
    for node in nodes:
        if rows >= rows_per_step:
            rows = 0
            await asyncio.sleep(0)
        for gpu in node.gpus:
            rows += 1
            labels = label_text(
                (
                    ("node", node.name),
                    ("device_uuid", gpu.uuid),
                    ("device_index", str(gpu.index)),
                    ("device_type", gpu.type),
                )
            )
            mem_limit.add(labels, gpu.devmem * _MIB)
            core_limit.add(labels, gpu.devcore)
            mem_alloc.add(labels, gpu.used_mem * _MIB)
            shared.add(labels, gpu.used_slots)
            core_alloc.add(labels, gpu.used_cores)
            overview.add(labels, gpu.used_mem * _MIB)
            mem_ratio.add(labels, gpu.used_mem / gpu.devmem if gpu.devmem else 0.0)
    for c in contributions:  # frozen: a pod's change replaces its contribution
        if rows >= rows_per_step:
            rows = 0
            await asyncio.sleep(0)
        for index, slot in enumerate(c.devices):
            for dev in slot:
                rows += 1
                labels = label_text(
                    (
                        ("namespace", c.namespace),
                        ("node", c.node),
                        ("pod", c.name),
                        ("container_index", str(index)),
                        ("device_uuid", dev.uuid),
                    )
                )
                vmem.add(labels, dev.usedmem * _MIB)
                vcore.add(labels, dev.usedcores)
    chunks = []
    for family in families:  # 1 MB each at 1,000 nodes: joined and encoded a piece a step
        for piece in family.pieces(_LINES_PER_CHUNK):
            await asyncio.sleep(0)
            chunks.append(piece.encode())
    return chunks


class QuotaCollector(Collector):
    """HAMi's quota gauges, read from the model when Prometheus scrapes (a few per namespace)."""

    def __init__(self, model: ClusterModel) -> None:
        self.model = model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._quotas()

    def _quotas(self) -> Iterator[GaugeMetricFamily]:
        """HAMi's quota gauges: per namespace and limited resource (``quota_name`` without the
        ``limits.`` prefix), what its pods hold (MiB, or percent of one GPU summed) and the limit
        (the lowest of its ResourceQuotas', all of which must hold)."""
        used = GaugeMetricFamily(
            "hami_resource_quota_used",
            "GPU resource a namespace's pods hold against its quota",
            labels=["namespace", "quota_name", "limit"],
        )
        limit = GaugeMetricFamily(
            "hami_resource_quota_limit",
            "GPU resource quota limit of a namespace",
            labels=["namespace", "quota_name"],
        )
        lowest: dict[tuple[str, str], int] = {}
        for q in self.model.quotas.all_limits():
            lowest[q.namespace, q.key] = min(q.limit, lowest.get((q.namespace, q.key), q.limit))
        memory_key = self.model.quotas.memory_key
        for (namespace, resource), value in sorted(lowest.items()):
            held = self.model.namespace_usage.get(namespace, (0, 0))[0 if resource == memory_key else 1]
            name = resource.removeprefix("limits.")
            used.add_metric([namespace, name, str(value)], held)
            limit.add_metric([namespace, name], value)
        yield from (used, limit)


class Metrics:
    """The extender's own metrics, plus the GPU collector once a model is attached."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.filter_seconds = Histogram(
            "hamipy_extender_filter_duration_seconds",
            "Time to answer one /filter (or /prioritize), by result.",
            ["result"],
            buckets=_FILTER_BUCKETS,
            registry=r,
        )
        self.bind_seconds = Histogram(
            "hamipy_extender_bind_duration_seconds",
            "Time to answer one /bind, lock waits included, by result.",
            ["result"],
            buckets=_BIND_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "hamipy_extender_decisions",
            "Filter and bind decisions by verb, result and reason.",
            ["verb", "result", "reason"],
            registry=r,
        )
        self.watch_waits = Histogram(
            "hamipy_extender_watch_wait_seconds",
            "Filters that waited for the pod watch to deliver the pod they name, by result (reached: "
            "the watch holds it or passed its version; timeout: answered without reserving).",
            ["result"],
            buckets=_WATCH_WAIT_BUCKETS,
            registry=r,
        )
        self.watch_waiting = Gauge(
            "hamipy_extender_watch_waiting",
            "Filters waiting now for the pod watch to deliver the pod they name.",
            registry=r,
        )
        self.malformed = Counter(
            "hamipy_extender_malformed_annotations",
            "Malformed annotations met on nodes and pods (their capacity is not offered).",
            ["kind", "field"],
            registry=r,
        )
        self.events_dropped = Counter(
            "hamipy_extender_events_dropped",
            "Kubernetes Events not posted (queue full or API error).",
            ["reason"],
            registry=r,
        )
        self.watch_restarts = Counter(
            "hamipy_extender_watch_restarts",
            "Watches restarted, by resource and cause (gone, error, closed).",
            ["resource", "cause"],
            registry=r,
        )
        self.lock_waits = Counter(
            "hamipy_extender_lock_waits", "Binds that found their node locked and waited.", registry=r
        )
        self.lock_breaks = Counter(
            "hamipy_extender_lock_breaks",
            "Node locks broken or freed late, by reason (expired, owner-gone, owner-done, owner-bound, "
            "malformed; released-late: our own release, retried after the API failed it).",
            ["reason"],
            registry=r,
        )
        self.bind_paths = Counter(
            "hamipy_extender_bind_paths",
            "Binds by how they decided: model (this replica alone writes allocations and our device "
            "plugin serves the node: no lock, no read) or locked (node lock and fresh API state).",
            ["path"],
            registry=r,
        )
        self.forwarded = Counter(
            "hamipy_extender_forwarded",
            "Decision requests this replica (not the leader) forwarded to the leader, by verb and "
            "result (answered, failed; redirected: answered with a 307 to it).",
            ["verb", "result"],
            registry=r,
        )
        self.pods_held = Gauge(
            "hamipy_extender_pods_held",
            "Pods holding GPUs in this replica's model, by source: allocated (bound, annotated), "
            "binding (a bind of this replica in flight), reserved (a filter's choice awaiting its bind).",
            ["source"],
            registry=r,
        )
        self.gpus_refused = Gauge(
            "hamipy_extender_gpus_refused",
            "GPU entries of node registers that are never offered, by reason: duplicate-uuid (an older "
            "node registers the same GPU UUID), zero-memory (registered with 0 MiB).",
            ["reason"],
            registry=r,
        )
        self.leader = Gauge(
            "hamipy_extender_leader",
            "1 while this replica decides (the only replica, or the Lease holder), else 0.",
            registry=r,
        )
        self.lock_releases_owed = Gauge(
            "hamipy_extender_lock_releases_owed",
            "Node locks of ours whose release failed and is being retried.",
            registry=r,
        )
        self.bind_races = Counter(
            "hamipy_extender_bind_races",
            "Binds whose pod another bind of it had bound first (left as that bind wrote it).",
            registry=r,
        )
        self.requeue_nudges = Counter(
            "hamipy_extender_requeue_nudges",
            "Node annotations written to make kube-scheduler retry pods the extender refused, once GPUs "
            "freed, by result (sent, failed).",
            ["result"],
            registry=r,
        )
        self.role_labels = Counter(
            "hamipy_extender_role_labels",
            "Writes of this replica's role onto its own pod (leader, follower), and writes that failed.",
            ["result"],
            registry=r,
        )
        self._model: ClusterModel | None = None
        # Known label values start at zero: a series that appears only at its first event hides
        # that event from rate() and increase() (dashboards show nothing, alerts see no increase).
        for result in ("fit", "failed", "passthrough", "prioritize"):
            self.filter_seconds.labels(result=result)
        for result in ("bound", "refused", "error"):
            self.bind_seconds.labels(result=result)
        for result in ("reached", "timeout"):
            self.watch_waits.labels(result=result)
        for result in ("refused", "error"):
            self.decisions.labels(verb="bind", result=result, reason=result)
        for verb in ("filter", "prioritize", "bind"):
            self.decisions.labels(verb=verb, result="unavailable", reason="BackgroundTaskDied")
        for verb in ("filter", "prioritize", "bind"):
            for result in ("answered", "failed", "redirected"):
                self.forwarded.labels(verb=verb, result=result)
        for result in ("sent", "failed"):
            self.requeue_nudges.labels(result=result)
        for result in ("leader", "follower", "failed"):
            self.role_labels.labels(result=result)
        for path in ("model", "locked"):
            self.bind_paths.labels(path=path)
        for reason in ("queue-full", "api-error"):
            self.events_dropped.labels(reason=reason)
        for resource in ("nodes", "pods"):
            for cause in ("gone", "error", "closed"):
                self.watch_restarts.labels(resource=resource, cause=cause)
        for reason in ("expired", "owner-gone", "owner-done", "owner-bound", "malformed", "released-late"):
            self.lock_breaks.labels(reason=reason)
        self.connections = HttpConnectionsCollector("hamipy_extender")
        """What the HTTP limits did on each port (``api``: filter/bind, ``probes``: the metrics port)."""
        r.register(self.connections)
        self.gc_pauses = GcPauses("hamipy_extender")
        """The garbage collector's pauses, timed while the server runs (``ExtenderServer``)."""
        r.register(self.gc_pauses)

    def attach(self, model: ClusterModel) -> None:
        """Serve the GPU and quota gauges from ``model``."""
        if self._model is None:
            self._model = model
            self.registry.register(QuotaCollector(model))
            for source in model.held:
                self.pods_held.labels(source=source).set_function(functools.partial(_held, model, source))
            for reason in (DUPLICATE_UUID, ZERO_MEMORY):
                self.gpus_refused.labels(reason=reason).set_function(
                    functools.partial(_refused, model, reason)
                )

    async def render_chunks(self) -> list[bytes]:
        """The exposition text in chunks (both protocols of the decision port and the probe server write them
        without joining): the registry's metrics, then the GPU gauges of the attached model (on
        the event loop, in steps: ``gpu_gauges``)."""
        gauges = [] if self._model is None else await gpu_gauges(self._model)
        await asyncio.sleep(0)  # the registry in a step of its own
        return [generate_latest(self.registry), *gauges]

    async def render(self) -> bytes:
        """``render_chunks`` joined."""
        return b"".join(await self.render_chunks())


def _held(model: ClusterModel, source: Source) -> float:
    return float(model.held[source])


def _refused(model: ClusterModel, reason: str) -> float:
    return float(model.refused_gpus(reason))


class Telemetry(ServiceTelemetry[Metrics]):
    """Logger, metrics and tracer of one extender."""

    SERVICE = SERVICE_NAME
    TRACER_NAME = "hamipy.extender"
    RECORD_UNEXPORTED = False  # it writes no trace context anywhere: unexported spans are waste

    @classmethod
    def new_metrics(cls) -> Metrics:
        return Metrics()
