"""What ``bench_e2e`` needs besides the cluster and the extender processes (``extender_processes``):
API request counts, CPU times.

- `apiserver_requests`: ``apiserver_request_total`` from the kube-apiserver's ``/metrics``, summed
  by (verb, resource, subresource) over codes, groups, versions, scopes and components.
- `RequestCounter`: what this process itself sends through one ``ApiClient``, keyed the way the
  apiserver keys ``apiserver_request_total``, so that it can be subtracted from the apiserver's counts;
  `quiet_apiserver`: wait until the apiserver serves (nearly) nothing but this process, so that a
  phase's counts and CPU are its own.
- `cpu_seconds`: user + system CPU time of a process, from ``/proc/<pid>/stat``;
  `runqueue_wait_seconds`: the time its threads waited for a CPU, from their ``schedstat``.
- `placement`: how a phase's pods lie on the nodes and GPUs (the most on one node and on one GPU),
  so that a spread burst bunched onto a few nodes shows in the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from hamipy.protocol import decode_pod_devices, keys

RequestKey = tuple[str, str, str]
"""(verb, resource, subresource) as ``apiserver_request_total`` labels them."""

_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>.*)\} (?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# Namespace subresources: /api/v1/namespaces/<name>/<these> is not a namespaced collection.
_NAMESPACE_SUBRESOURCES = frozenset({"finalize", "status"})


def histogram_mean_ms(texts: Iterable[str], name: str) -> float:
    """Mean of histogram ``name`` in milliseconds over every label set of every text (replicas)."""
    total = count = 0.0
    for text in texts:
        for line in text.splitlines():
            if line.startswith(f"{name}_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"{name}_count"):
                count += float(line.rsplit(" ", 1)[1])
    return round(1000 * total / count, 2) if count else 0.0


def family_samples(texts: Iterable[str], name: str) -> Iterator[Sample]:
    """The samples of family ``name`` in every text (replicas). Only the family's lines are parsed:
    an extender's scrape at 1,000 nodes is 10 MB."""
    for text in texts:
        lines = "\n".join(line for line in text.splitlines() if line.startswith(name))
        for family in text_string_to_metric_families(lines + "\n"):
            yield from family.samples


def counter_by_label(
    texts: Iterable[str], name: str, label: str, where: Mapping[str, str] | None = None
) -> Counter[str]:
    """Counter ``name`` (its ``_total`` samples) summed over every text (replicas) by ``label``'s
    value; only the samples whose labels include ``where``'s."""
    want = (where or {}).items()
    sums: Counter[str] = Counter()
    for sample in family_samples(texts, name):
        if sample.name == f"{name}_total" and want <= sample.labels.items():
            sums[sample.labels.get(label, "")] += int(sample.value)
    return sums


def gc_pauses(texts: Iterable[str], name: str = "hamipy_extender_gc_pause_seconds") -> dict[str, list[float]]:
    """Per generation of the garbage collector: [collections, seconds] (histogram ``name``), summed
    over every text (replicas)."""
    out: dict[str, list[float]] = {}
    for sample in family_samples(texts, name):
        sums = out.setdefault(sample.labels["generation"], [0.0, 0.0])
        if sample.name == f"{name}_count":
            sums[0] += sample.value
        elif sample.name == f"{name}_sum":
            sums[1] += sample.value
    return out


def connection_cuts(texts: Iterable[str], prefix: str = "hamipy_extender") -> dict[str, int]:
    """``<prefix>_http_connections_closed_total`` by reason (non-zero only), summed over every text
    (replicas) and server: connections the HTTP limits cut, refused at the cap among them."""
    cuts = counter_by_label(texts, f"{prefix}_http_connections_closed", "reason")
    return {reason: n for reason, n in sorted(cuts.items()) if n}


# -- the apiserver's request counts ------------------------------------------------------------


async def apiserver_metrics(api: Any) -> str:
    """The kube-apiserver's ``/metrics`` through the admin ``ApiClient`` (Prometheus text)."""
    resp = await api.call_api(
        "/metrics",
        "GET",
        header_params={"Accept": "text/plain"},
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=60,
    )
    try:
        if resp.status != 200:
            raise RuntimeError(f"GET /metrics: HTTP {resp.status}: {(await resp.read())[:200]!r}")
        return str(await resp.text())
    finally:
        resp.release()


def parse_request_counts(text: str) -> Counter[RequestKey]:
    """``apiserver_request_total`` summed by (verb, resource, subresource)."""
    counts: Counter[RequestKey] = Counter()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
        counts[key] += int(float(match["value"]))
    return counts


async def apiserver_requests(api: Any) -> Counter[RequestKey]:
    return parse_request_counts(await apiserver_metrics(api))


def request_key(method: str, url: str, query: Iterable[tuple[str, Any]] | None) -> RequestKey:
    """How ``apiserver_request_total`` labels a request: verbs ``GET``/``LIST``/``WATCH``/``POST``/
    ``PUT``/``PATCH``/``DELETE``/``DELETECOLLECTION``; a path outside ``/api`` and ``/apis`` (such
    as ``/metrics``) has no resource and the path as its subresource."""
    method = method.upper()
    parts = [p for p in urlsplit(url).path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        rest = parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        rest = parts[3:]
    else:
        return method, "", "/" + "/".join(parts)
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in _NAMESPACE_SUBRESOURCES:
        rest = rest[2:]
    resource = rest[0] if rest else ""
    named = len(rest) >= 2
    subresource = rest[2] if len(rest) >= 3 else ""
    verb = method
    if method == "GET":
        watch = any(k == "watch" and str(v).lower() in ("true", "1") for k, v in (query or ()))
        verb = "WATCH" if watch else ("GET" if named else "LIST")
    elif method == "DELETE" and not named:
        verb = "DELETECOLLECTION"
    return verb, resource, subresource


UNCOUNTED: frozenset[RequestKey] = frozenset({("GET", "", "/metrics")})
"""Requests the kube-apiserver leaves out of ``apiserver_request_total``: its ``/metrics`` (a
``/readyz`` is counted, a ``/metrics`` is not)."""


class RequestCounter:
    """Counts every request sent through one kubernetes_asyncio ``ApiClient`` (its aiohttp session's
    ``request``, under both the generated APIs and ``RawKube``, which sends on that session itself),
    by `request_key`, when it is sent."""

    def __init__(self, api: Any) -> None:
        self.counts: Counter[RequestKey] = Counter()
        session = api.rest_client.pool_manager
        send = session.request

        def counted(method: str, url: Any, **kwargs: Any) -> Any:
            key = request_key(method, str(url), parse_qsl(urlsplit(str(url)).query))
            if key not in UNCOUNTED:
                self.counts[key] += 1
            return send(method, url, **kwargs)

        session.request = counted

    def reset(self) -> None:
        self.counts.clear()

    def snapshot(self) -> Counter[RequestKey]:
        return Counter(self.counts)


def key_name(key: RequestKey) -> str:
    verb, resource, subresource = key
    if not resource:
        return f"{verb} {subresource or '(none)'}"
    return f"{verb} {resource}/{subresource}" if subresource else f"{verb} {resource}"


def others(
    before: Counter[RequestKey], after: Counter[RequestKey], own: Mapping[RequestKey, int]
) -> Counter[RequestKey]:
    """What the apiserver served between two scrapes beyond ``own`` (this process's requests)."""
    out: Counter[RequestKey] = Counter()
    for key, value in after.items():
        extra = value - before.get(key, 0) - own.get(key, 0)
        if extra > 0:
            out[key] = extra
    return out


async def quiet_apiserver(
    api: Any,
    counter: RequestCounter,
    *,
    interval_s: float = 1.0,
    allowance: int = 3,
    timeout_s: float = 300.0,
) -> tuple[Counter[RequestKey], float]:
    """Scrape ``apiserver_request_total`` every ``interval_s`` until an interval passes in which the
    apiserver served at most ``allowance`` requests other than this process's own (its leases and
    controllers' resyncs are a few in ten seconds; kube-controller-manager's TTL controller
    annotating new nodes is 20 a second until it has been through them all); the last scrape, with
    ``counter`` reset right after it, and the seconds waited. Gives up quietly after ``timeout_s``."""
    started = time.monotonic()
    previous = await apiserver_requests(api)
    counter.reset()
    while True:
        await asyncio.sleep(interval_s)  # a sampling interval: a rate is what is being waited for
        current = await apiserver_requests(api)
        own = counter.snapshot()
        counter.reset()
        waited = time.monotonic() - started
        if sum(others(previous, current, own).values()) <= allowance or waited > timeout_s:
            return current, waited
        previous = current


def request_figures(
    before: Counter[RequestKey],
    after: Counter[RequestKey],
    own: Mapping[RequestKey, int],
    pods: int,
    top: int = 10,
) -> dict[str, Any]:
    """API requests per placed pod over a phase: all, and without what this process sent itself."""
    delta = others(before, after, {})
    not_own = others(before, after, own)
    # Requests the bench counted but the apiserver did not (yet): in flight at the scrape.
    unseen = sum(max(0, n - delta.get(k, 0)) for k, n in own.items())

    def per_pod(counts: Counter[RequestKey]) -> dict[str, float]:
        return {key_name(k): round(v / pods, 3) for k, v in counts.most_common(top)}

    return {
        "total": sum(delta.values()),
        "per_pod": round(sum(delta.values()) / pods, 2),
        "bench_own": sum(own.values()),
        "bench_own_unseen": unseen,
        "per_pod_excluding_bench": round(sum(not_own.values()) / pods, 2),
        "top_per_pod": per_pod(delta),
        "top_per_pod_excluding_bench": per_pod(not_own),
        "delta": {key_name(k): v for k, v in delta.most_common()},
        "bench_own_by_key": {key_name(k): v for k, v in Counter(own).most_common()},
    }


# -- CPU ---------------------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when it is gone)."""
    if pid is None:
        return 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def runqueue_wait_seconds(pid: int) -> float:
    """Seconds the threads of process ``pid`` have spent runnable but waiting for a CPU (the
    second field of each ``/proc/<pid>/task/<tid>/schedstat``; 0 when it is gone): on a saturated
    machine, how much of a request's latency is the process waiting for a core, not working."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def connections_to(pid: int, port: int) -> int:
    """How many TCP connections process ``pid`` has open to ``port`` on this host (its sockets in
    ``/proc/<pid>/fd`` matched by inode against ``/proc/net/tcp``)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].split(":")[1], 16)
        if remote_port == port and fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
            count += 1
    return count


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident set size of process ``pid`` in MiB: now (``VmRSS``), or its peak (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"process {pid} reports no {field} (gone, or a kernel thread)")


# -- placement -----------------------------------------------------------------------------------


def placement(pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Where bound pods lie: ``nodes`` used, the most pods on one node (``most_per_node``) and, from
    their ``hami.io/vgpu-devices-allocated``, on one GPU (``most_per_gpu``; 0 when no pod carries
    one, as a phase without the extender). Under spread a node takes a second pod only when every
    node kube-scheduler sent has one, and a GPU never does before every GPU of its node has one."""
    per_node: Counter[str] = Counter()
    per_gpu: Counter[str] = Counter()
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            continue
        per_node[node] += 1
        allocated = ((pod.get("metadata") or {}).get("annotations") or {}).get(keys.DEVICES_ALLOCATED)
        if allocated:
            per_gpu.update({dev.uuid for slot in decode_pod_devices(allocated) for dev in slot})
    return {
        "nodes": len(per_node),
        "most_per_node": max(per_node.values(), default=0),
        "most_per_gpu": max(per_gpu.values(), default=0),
    }
