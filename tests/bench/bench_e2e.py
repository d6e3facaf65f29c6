"""Benchmark: pods placed end to end through the real kube-scheduler (docs/design.md#performance-targets:
pods/s at 1,000 simulated nodes against the same kube-scheduler without an extender, and against
an absolute 200 pods/s; 40 identical pods onto one 8-GPU node all bound and allocated
within seconds).

Run as a script: ``.venv/bin/python tests/bench/bench_e2e.py [--nodes 1000] [--pods 1000] [--rounds 2]``.

Part 1, placement rate: a devcluster and ``--nodes`` simulated nodes, registered once, each with 8
GPUs (the register annotation and ``nvidia.com/gpu`` capacity 80, as the device plugin writes them).
Then, ``--rounds`` times, the phases (four unless ``--phases`` says otherwise) one after the other
on the same nodes, so that the machine's noise falls on all alike:

- ``bare``: the ``hami-scheduler`` kube-scheduler with no extender (the ceiling), ``--pods`` pods
  asking only ``nvidia.com/gpu: 1``, which kube-scheduler fits against the nodes' capacity itself;
- ``bare3res`` (only when ``--phases`` names it): the same kube-scheduler with no extender placing
  the pods ours place (``nvidia.com/gpu``, ``gpumem`` and ``gpucores``), the last two in
  NodeResourcesFit's ``ignoredResources``, as the extender's ``managedResources`` leave them: the
  ceiling for the pods the wire protocol gives, which separates what the pod's shape costs
  kube-scheduler from what the extender costs (``<phase>_vs_bare3res``);
- ``binpack`` and ``spread``: the same kube-scheduler wired to the extender (filter and bind,
  adaptive ``percentageOfNodesToScore`` as for ``bare``), ``--pods`` pods asking 1 GPU, 2,000 MiB
  and 5 % cores; the extender runs as users run it, ``hamipy-extender serve`` in a process of its
  own (plain HTTP on loopback, or with ``--tls`` HTTPS demanding kube-scheduler's client
  certificate, as the chart serves it; ``nodeSchedulerPolicy`` from a ``--config`` file, handshake
  stamping off), a fresh one per phase, since it keeps its model from watches (`start_extender_processes` can
  start several replicas; the scheduler calls replica 0);
- ``binpack3``: as ``binpack`` with 3 replicas electing a leader (``--leader-elect``) and
  kube-scheduler pinned to a follower, as kube-proxy pins a kept-alive connection: every request is
  forwarded to the leader, the worst case of a Service (all replicas share this machine's cores);
- ``binpack3r`` (only when ``--phases`` names it): as ``binpack3`` with ``--follower-redirect``: the
  follower answers each request with a 307 to the leader, which kube-scheduler then calls itself;
- ``binpack3rc`` (only when ``--phases`` names it): as ``binpack3r`` with ``--cold-standby``: the
  followers watch nothing until they lead, so on this shared machine they take no CPU per pod;
- ``binpack3s`` (only when ``--phases`` names it): as ``binpack3rc`` with kube-scheduler calling the
  leader, as the chart's Service does (it selects the pod labelled ``hami-py.io/extender-role=leader``,
  ``--own-pod``): no request pays a follower's hop;

``--phases`` picks some of them (``bare`` always runs: the ratios are to it).

In every extender phase the simulated nodes' device plugins serve each pod once bound
(``_device_plugins.py``, a process of its own: the device plugin's own ``Allocator``, one per node,
as the kubelet's Allocate would call it): they patch the pod (``bind-phase=success``, its
allocation slot emptied) and release the node lock if the pod holds it, so an extender phase's pods
are done when allocated, and its CPU and API requests include those writes, as in a cluster
(``--no-device-plugins``: left out, done when bound). A ``bare`` pod is done when bound: the device
plugin of ``nvidia.com/gpu`` alone writes nothing to the API server.

Each phase starts from empty nodes in a namespace of its own and, once the kube-apiserver has a
second with at most 3 requests that are not the benchmark's (after the nodes are registered,
kube-controller-manager's TTL controller patches each of them, 20 a second), creates its pods 32 at
a time and measures from the first create to the last pod done (seen by a watch), and per pod
from its creation to done; then its pods and namespace are deleted and waited for until gone.
Reported per phase: pods/s, where the pods went (the most on one node and on one GPU: under spread a
burst must not bunch, a node taking a second pod while a node sent with it has none), the binds the
extender refused (``pod no longer fits node ...``: under binpack a filter must not choose a node its
own bind then finds full) and the filters it answered for a pod its watch had not delivered yet
(with ``--filter-probe``, the probe's among them), the extender's mean ``/filter`` and ``/bind``
durations (from its ``/metrics``), with ``--filter-probe`` ``/filter`` as a client sees it while the
binds run (a probe 20 times a second with 420 node names, for a pod the extender has not watched and
with no resourceVersion: it decides at once and reserves nothing; asked from a process of its own,
as kube-scheduler asks, with a blocking HTTP/1.1 client as cheap as Go's; p99 in the table, "client
p99", and every round's samples pooled per phase at the end, with the kernel's arrival time of each
answer beside the time the probe read it; its own load lowers the rates), CPU seconds of
each process from the first create to 1 s after the last pod done, and per placed pod the CPU
milliseconds of the whole pipeline (control plane, extenders and device plugins, ``cpu ms/pod``;
this process, the users, apart) against ``bare``'s (and the seconds the extender
spent runnable but waiting for a CPU, "ext waited"), the seconds the extenders' garbage collector
held them by generation (``hamipy_extender_gc_pause_seconds``, "gc s" 0/1/2), and
the kube-apiserver's requests per placed pod: ``apiserver_request_total`` from its ``/metrics``
before the first create and 1 s after the last pod is bound (kube-scheduler sends its events late),
by (verb, resource, subresource); "excluding the bench" subtracts what this process sent itself in
that window (pod creates, its watch, the simulated nodes' heartbeats), counted at its API client
by the same keys. Per round, ours / bare; over the rounds, the medians. A table goes to stdout,
everything to ``tests/bench/results/e2e_placement.json``.

With ``--split-cpus`` every phase runs the control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager) on half the CPUs and the extenders, the filter probe and this process (the
users creating pods) on the other half: the rate is then what the control plane can place, and the
extender's own CPU comes from beside it, as in a cluster where it runs with a CPU request of its
own. Without it every process shares every CPU, and the rate follows the CPU each pod costs them all.
``--bench-beside-control-plane`` moves this process to the control plane's CPUs, leaving the others
to the extenders and the probe alone (the extender as with a guaranteed CPU of its own).
``--backlog N`` creates, before each phase's burst, N pods that fit no node (``waiting_pods``), the
backlog of a busy GPU cluster: kube-scheduler tries them again after backoffs and on cluster events,
so the extender answers filters that fit nowhere while the binds run.
``--extender-args '--api-connections 24'`` gives every extender process those flags (to compare a
setting run by run); ``--variant LABEL:NAME=VALUE`` runs each extender phase once more a round as
``<phase>+LABEL`` with ``NAME=VALUE`` in its extenders' environment (repeatable; the phase and its
variants in an order rotated by round), and reports ``<phase>+LABEL`` / ``<phase>`` per round and
their medians (pods/s and CPU per pod); ``--profile-extender DIR`` records each extender with
py-spy while the pods are placed. Each extender phase's line also counts the connections
kube-scheduler opened to the extenders (``conns``: Go's client keeps two idle per host, so binds
in flight open new ones) and the extenders' peak RSS (``VmHWM``).

Part 2, one node: a simulated GPU node with 8 GPUs, its real device-plugin process over the fake
NVML driver and the kubelet stand-in, and an extender in this process; 40 identical pods (1 GPU,
4 GiB, 10 % cores) created at once and timed until every one is bound and allocated
(``hami.io/bind-phase=success``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: extender_processes
sys.path.insert(0, str(Path(__file__).parent))

import aiohttp
from _e2e_support import (
    RequestCounter,
    apiserver_requests,
    connection_cuts,
    counter_by_label,
    cpu_seconds,
    family_samples,
    gc_pauses,
    histogram_mean_ms,
    own_cpu_seconds,
    placement,
    quiet_apiserver,
    request_figures,
    rss_mib,
    runqueue_wait_seconds,
)
from _results import percentiles_us, record
from extender_processes import ExtenderProcess, LoopbackPki, start_extender_processes, stop_extenders

from hamipy.devcluster import (
    HAMI_SCHEDULER_NAME,
    DevCluster,
    ExtenderConfig,
    ManagedResource,
    NodePool,
    NodeSpec,
    SchedulerConfig,
    create_namespace,
    delete_namespace,
    wait_for,
    wait_for_default_service_account,
)
from hamipy.devcluster.binaries import ensure_binaries
from hamipy.devcluster.cluster import ClusterSettings
from hamipy.devcluster.gpu_nodes import FakeGpu, gpu_node_agents
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import RawKube
from hamipy.kube.errors import NotFound
from hamipy.protocol import DeviceInfo, encode_node_devices, keys
from hamipy.protocol.config import Config
from hamipy.protocol.node_handshake import plugin_report

ROOT = Path(__file__).resolve().parents[2]
GPUS = 8
GPU_SPLIT = 10
"""Pods a GPU of the bench's nodes takes (its split count)."""
GPU_MEM_MIB = 40960
TARGET_PODS_PER_S = 200.0
TIMEOUT_S = 600.0
HEARTBEAT_S = 6 * 3600.0
"""The simulated nodes' heartbeat: the devcluster runs no node-lifecycle controller, so a node stays
Ready without one, and a round of 1,000 nodes' status and Lease writes landing inside a phase
costs the kube-apiserver as much as hundreds of pods."""
DELETE_TIMEOUT_S = 180.0
"""Per request of a phase's clean-up: deleting a collection of thousands of pods took the API
server over its usual 30 s on this machine's slow days (with the control plane on one CPU)."""
SETTLE_S = 1.0
"""After the last pod is bound, before the closing scrape: kube-scheduler sends its events late."""
EXTENDER_REPLICAS = 1
MANAGED = tuple(ManagedResource(r) for r in (keys.RESOURCE_COUNT, keys.RESOURCE_MEMORY, keys.RESOURCE_CORES))
PHASES = ("bare", "binpack", "spread", "binpack3")
"""The phases a run has unless ``--phases`` says otherwise."""
KNOWN_PHASES = (*PHASES, "binpack3r", "binpack3rc", "binpack3s", "bare3res")
BASELINES = ("bare", "bare3res")
"""Phases with no extender: every other phase is compared with each of them that ran."""
ELECTED_REPLICAS = 3
"""``binpack3``: this many replicas electing a leader, kube-scheduler pinned to a follower (as
kube-proxy pins a kept-alive connection): every request is forwarded, the worst case of a Service."""
# Processes whose CPU time a phase reports (the devcluster's names; the extenders are added).
CPU_PROCESSES = {
    "apiserver": "kube-apiserver",
    "etcd": "etcd",
    "scheduler": "kube-scheduler-hami",
    "controller_manager": "kube-controller-manager",
}


CONTROL_PLANE = tuple(CPU_PROCESSES)
PIPELINE = (*CONTROL_PLANE, "extender", "plugins")
"""The processes a placed pod costs CPU in: the control plane, the extenders and the nodes' device
plugins (``plugins``); not this process (the users creating pods and watching them)."""

WAITED = "extender_runqueue_wait"
"""``Bench.cpu``'s key for the extenders' run-queue wait (seconds runnable without a CPU)."""


def gpu_pod(name: str, *, selector: Mapping[str, str], limits: Mapping[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": HAMI_SCHEDULER_NAME,
            "nodeSelector": dict(selector),
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "main", "image": "registry.invalid/app:1", "resources": {"limits": dict(limits)}}
            ],
        },
    }


def our_limits(mem: int, cores: int) -> dict[str, str]:
    """One GPU with ``mem`` MiB and ``cores`` % of its cores: the extender's resources."""
    return {keys.RESOURCE_COUNT: "1", keys.RESOURCE_MEMORY: str(mem), keys.RESOURCE_CORES: str(cores)}


BARE_LIMITS: Mapping[str, str] = {keys.RESOURCE_COUNT: "1"}
"""The bare phase's pods: one ``nvidia.com/gpu``, which kube-scheduler fits against capacity itself."""
OUR_LIMITS: Mapping[str, str] = our_limits(2000, 5)


def waiting_pods(count: int, *, extender: bool) -> list[dict[str, Any]]:
    """``count`` pods that fit no node, as a backlog waiting for GPUs: with an extender, ours asking
    1 MiB more than a GPU has (kube-scheduler passes them to the extender, which fits them nowhere);
    without, more GPUs than a node has (kube-scheduler itself refuses them). kube-scheduler tries
    them again after a backoff and on cluster events, throughout the phase."""
    limits = (
        {**OUR_LIMITS, keys.RESOURCE_MEMORY: str(GPU_MEM_MIB + 1)}
        if extender
        else {keys.RESOURCE_COUNT: str(GPUS * GPU_SPLIT + 1)}
    )
    return [gpu_pod(f"wait-{i:05d}", selector={"bench": "rate"}, limits=limits) for i in range(count)]


async def create_all(api: Any, namespace: str, bodies: list[dict[str, Any]]) -> dict[str, float]:
    """Create every pod (32 in flight; answers decoded as JSON, not into models); each pod's
    creation time."""
    kube = RawKube(api)
    created: dict[str, float] = {}
    gate = asyncio.Semaphore(32)

    async def one(body: dict[str, Any]) -> None:
        async with gate:
            await kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=body, timeout_s=30)
            created[body["metadata"]["name"]] = time.perf_counter()

    await asyncio.gather(*(one(b) for b in bodies))
    return created


async def wait_all(api: Any, namespace: str, names: set[str], done: Any) -> dict[str, float]:
    """Watch the namespace's pods (raw JSON) until ``done(pod)`` for every name; when each was first
    seen done. A watch, not polling: LISTing 1,000 pods four times a second cost the kube-apiserver
    more CPU than a phase's scheduling did, and the slower a phase, the more polls it paid for."""
    kube = RawKube(api)
    path = f"/api/v1/namespaces/{namespace}/pods"
    seen: dict[str, float] = {}
    deadline = time.monotonic() + TIMEOUT_S

    def note(pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if name in names and name not in seen and done(pod):
            seen[name] = time.perf_counter()

    listed = await kube.request("GET", path, timeout_s=30)
    for pod in listed["items"]:
        note(pod)
    version = listed["metadata"]["resourceVersion"]
    while len(seen) < len(names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(names) - len(seen)} pods not done after {TIMEOUT_S:g}s")
        query = [("watch", "1"), ("resourceVersion", version), ("allowWatchBookmarks", "true")]
        query.append(("timeoutSeconds", str(max(1, int(deadline - time.monotonic())))))
        async for event in kube.stream(path, query=query, inactivity_s=TIMEOUT_S):
            obj = event.get("object") or {}
            if event.get("type") == "ERROR":
                raise RuntimeError(f"watch of {path} failed: {obj.get('message')}")
            version = obj.get("metadata", {}).get("resourceVersion", version)
            if event.get("type") in ("ADDED", "MODIFIED"):
                note(obj)
            if len(seen) == len(names):
                break
    return seen


async def start_extender(cluster: DevCluster, api: Any, config: Config) -> ExtenderServer:
    """Part 2: one extender in this process, synced, and the hami-scheduler (re)started to call it."""
    server = ExtenderServer(
        config=config,
        settings=ExtenderSettings(handshake_interval_s=0),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=RawKube(api),
    )
    await server.start()
    await server.wait_synced(120)
    await asyncio.to_thread(cluster.start_scheduler, scheduler_config(server.url), name="hami")
    return server


def elected_args(
    lease: str, *, redirect: bool = False, cold: bool = False
) -> Callable[[int, int], list[str]]:
    """Flags of replica ``index`` on ``port`` electing a leader by the Lease ``default/<lease>``
    (followers redirecting to it with ``redirect``, else forwarding; watching nothing until they
    lead with ``cold``)."""

    def args(index: int, port: int) -> list[str]:
        return [
            "--follower-redirect" if redirect else "--no-follower-redirect",
            "--cold-standby" if cold else "--no-cold-standby",
            "--leader-elect",
            "--lease-namespace",
            "default",
            "--lease-name",
            lease,
            "--identity",
            f"bench-{index}",
            "--advertise-url",
            f"http://127.0.0.1:{port}",
        ]

    return args


PROBE_INTERVAL_S = 0.05
"""How often the filter probe asks while a phase places its pods (20 a second, beside ~100 real)."""
PROBE_NODES = 420
"""Node names per probe: kube-scheduler's adaptive share of 1,000 nodes (42 %)."""


def favour(pid: int, boost: int) -> None:
    """Run process ``pid`` at nice ``-boost``, its session's autogroup too: with autogroups (the
    kernel's default) a process started in a session of its own, as the extenders are, competes as
    that group, whatever its own nice (as a container competes by its cgroup's CPU weight)."""
    if boost:
        os.setpriority(os.PRIO_PROCESS, pid, -boost)
        with contextlib.suppress(FileNotFoundError):  # a kernel without autogroups
            Path(f"/proc/{pid}/autogroup").write_text(str(-boost))


def pin_process(pid: int, cpus: set[int] | None) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (None: leave it be). Threads it starts later
    inherit the mask of the thread that starts them, so the whole process stays there."""
    if cpus is None:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


@dataclasses.dataclass(frozen=True)
class CpuSplit:
    """``--split-cpus``: the control plane (etcd, kube-apiserver, kube-scheduler,
    kube-controller-manager) on ``control_plane``, the extenders, the filter probe and this process
    (the users creating pods) on ``rest``, in every phase alike: the extender's own CPU then comes
    from beside the control plane, as its Deployment's CPU request does, and the rate of each phase
    is what its control plane can place."""

    control_plane: set[int]
    rest: set[int]
    bench_beside_control_plane: bool = False
    """``--bench-beside-control-plane``: this process creates pods from the control plane's CPUs, so
    that the extenders and the probe have theirs to themselves."""

    @classmethod
    def of_machine(cls, *, bench_beside_control_plane: bool = False) -> CpuSplit:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--split-cpus needs at least 2 CPUs")
        half = len(cpus) // 2
        return cls(set(cpus[:half]), set(cpus[half:]), bench_beside_control_plane)


async def probe_filters(
    url: str,
    nodes: int,
    stop: asyncio.Event,
    *,
    boost: int = 0,
    cpus: set[int] | None = None,
    tls: LoopbackPki | None = None,
) -> dict[str, list[float]]:
    """Client-side ``/filter`` latencies (seconds) while binds run: a pod the extender has not
    watched (it decides, and reserves nothing), every ``PROBE_INTERVAL_S`` until ``stop``; asked
    from a process of its own (``_filter_probe.py``), as kube-scheduler asks. ``wall``: from the
    send to the answer read; ``arrival``: to the kernel's receive time of the answer. Over TLS (an
    https ``url``) with ``tls``'s client certificate."""
    body = gpu_pod("probe", selector={"bench": "rate"}, limits=OUR_LIMITS)
    body["metadata"].update(namespace="bench-probe", uid="00000000-0000-4000-8000-00000000probe")
    names = [f"bench-{i:05d}" for i in range(0, nodes, max(1, nodes // PROBE_NODES))][:PROBE_NODES]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).with_name("_filter_probe.py")),
        url,
        str(PROBE_INTERVAL_S),
        *((str(tls.ca), str(tls.client_cert), str(tls.client_key)) if tls is not None else ()),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    favour(process.pid, boost)
    pin_process(process.pid, cpus)
    assert process.stdin is not None
    process.stdin.write(json.dumps({"Pod": body, "NodeNames": names}).encode() + b"\n")
    await process.stdin.drain()
    await stop.wait()
    process.stdin.close()
    out, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    if process.returncode != 0:
        raise RuntimeError(f"the filter probe exited {process.returncode}")
    samples: dict[str, list[float]] = json.loads(out)
    return samples


async def start_profiler(pid: int, out: Path) -> asyncio.subprocess.Process:
    """``py-spy record`` of process ``pid`` into ``out`` (collapsed stacks, ``--format raw``)
    until `stop_profiler`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return await asyncio.create_subprocess_exec(
        "py-spy",
        "record",
        "--pid",
        str(pid),
        "--format",
        "raw",
        "--output",
        str(out),
        "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def stop_profiler(process: asyncio.subprocess.Process) -> None:
    """End a `start_profiler` recording (SIGINT: py-spy then writes its file)."""
    process.send_signal(signal.SIGINT)
    await asyncio.wait_for(process.wait(), timeout=60)


@dataclasses.dataclass
class DevicePlugins:
    """The simulated nodes' device plugins (``_device_plugins.py``): one process serving, for every
    node, what its device plugin writes per pod at Allocate."""

    process: asyncio.subprocess.Process

    @classmethod
    async def start(cls, kubeconfig: Path, namespace: str, hook_dir: Path) -> DevicePlugins:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).with_name("_device_plugins.py")),
            str(kubeconfig),
            namespace,
            str(hook_dir),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout=60)
        if line.strip() != b"ready":
            process.kill()
            raise RuntimeError(f"the device plugins did not start: {line!r}")
        return cls(process)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def stop(self) -> dict[str, int]:
        """Allocations served and failed."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        out, _ = await asyncio.wait_for(self.process.communicate(), timeout=60)
        if self.process.returncode != 0:
            raise RuntimeError(f"the device plugins exited {self.process.returncode}")
        counts: dict[str, int] = json.loads(out)
        return counts


def allocated(pod: Mapping[str, Any]) -> bool:
    """The device plugin has served the pod (``hami.io/bind-phase=success``)."""
    return (pod["metadata"].get("annotations") or {}).get(keys.BIND_PHASE) == "success"


def bound(pod: Mapping[str, Any]) -> bool:
    return bool(pod["spec"].get("nodeName"))


async def wait_leader(extenders: list[ExtenderProcess]) -> ExtenderProcess:
    """The replica whose ``hamipy_extender_leader`` is 1, once one is."""
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            for e in extenders:
                if re.search(r"^hamipy_extender_leader 1(\.0)?$", await e.metrics(session), re.M):
                    return e
            await asyncio.sleep(0.2)  # a benchmark's poll, not test synchronisation
    raise TimeoutError("no extender replica became the leader within 60s")


def scheduler_config(extender_url: str | None, tls: LoopbackPki | None = None) -> SchedulerConfig:
    """The ``hami-scheduler`` profile, calling the extender at ``extender_url`` (None: no extender),
    over TLS with ``tls``'s client certificate (an https URL) as the chart configures it."""
    if extender_url is None:
        return SchedulerConfig(profiles=(HAMI_SCHEDULER_NAME,))
    extender = ExtenderConfig(
        url_prefix=extender_url,
        bind_verb="bind",
        node_cache_capable=True,
        managed_resources=MANAGED,
        http_timeout_s=30,
        tls=tls.scheduler() if tls is not None else None,
    )
    return SchedulerConfig.hami(extender)


async def add_nodes(pool: NodePool, nodes: int) -> float:
    """Register ``nodes`` GPU nodes as our device plugin does (register, ``Reported_`` handshake and
    our marker: the extender binds there from its model); seconds it took."""
    started = time.perf_counter()
    report = plugin_report(datetime.now(UTC))
    for i in range(nodes):
        devices = [
            DeviceInfo(
                f"GPU-{i:05d}-{g}",
                g,
                GPU_SPLIT,
                GPU_MEM_MIB,
                100,
                "NVIDIA-A100-SXM4-40GB",
                g // 4,
                "hami-core",
                True,
            )
            for g in range(GPUS)
        ]
        await pool.add(
            NodeSpec(
                name=f"bench-{i:05d}",
                labels={"bench": "rate"},
                annotations={keys.NODE_REGISTER: encode_node_devices(devices), **report},
                capacity={keys.RESOURCE_COUNT: str(GPUS * GPU_SPLIT)},
            )
        )
    return time.perf_counter() - started


@dataclasses.dataclass
class Bench:
    """What every placement phase shares: the cluster, the nodes, and this process's API client."""

    cluster: DevCluster
    api: Any
    counter: RequestCounter
    workdir: Path
    nodes: int
    pods: int
    replicas: int = EXTENDER_REPLICAS
    filter_probe: bool = False
    """Probe ``/filter`` from the client side while the binds run (``--filter-probe``)."""
    favour: int = 0
    """``--favour-extender N``: the extenders and the probe run at nice -N (a core of their own, as
    when the extender runs with its own CPU request beside a busy control plane)."""
    split: CpuSplit | None = None
    """``--split-cpus``: the control plane on CPUs of its own (``CpuSplit``)."""
    backlog: int = 0
    """``--backlog N``: pods that fit nowhere, created before each phase's burst (``waiting_pods``)."""
    extender_args: tuple[str, ...] = ()
    """``--extender-args``: flags every extender process gets (to compare settings run by run)."""
    profile_dir: Path | None = None
    """``--profile-extender DIR``: each extender is recorded by py-spy while a phase's pods are
    placed, into ``DIR/round-<n>-<phase>-<replica>.txt`` (its own sampling costs CPU: not for
    the rates)."""
    variants: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    """``--variant LABEL:NAME=VALUE``: label -> the environment its extenders get; each extender
    phase runs once more a round per label (``<phase>+LABEL``), in an order rotated by round."""
    tls: LoopbackPki | None = None
    """``--tls``: the extenders serve HTTPS demanding kube-scheduler's client certificate, as the
    chart deploys them (binpack and spread phases)."""
    device_plugins: bool = True
    """The simulated nodes' device plugins serve each pod the extender binds (``DevicePlugins``);
    an extender phase's pods are done when allocated (off: ``--no-device-plugins``, when bound)."""

    def pin(self, extenders: list[ExtenderProcess], plugins: DevicePlugins | None) -> None:
        """Apply ``split`` to every process of the phase (kube-scheduler is new in each); the
        device plugins run beside the extenders, off the control plane's CPUs, as on nodes."""
        if self.split is None:
            return
        for process in self.cluster.processes.values():
            if process.pid is not None:
                pin_process(process.pid, self.split.control_plane)
        for pid in [e.pid for e in extenders] + ([plugins.pid] if plugins else []):
            pin_process(pid, self.split.rest)
        split = self.split
        pin_process(os.getpid(), split.control_plane if split.bench_beside_control_plane else split.rest)

    def cpu(self, extenders: list[ExtenderProcess], plugins: DevicePlugins | None) -> dict[str, float]:
        procs = self.cluster.processes
        out = {
            key: cpu_seconds(procs[name].pid) if name in procs else 0.0 for key, name in CPU_PROCESSES.items()
        }
        out["extender"] = sum(cpu_seconds(e.pid) for e in extenders)
        out["plugins"] = cpu_seconds(plugins.pid) if plugins else 0.0
        out["bench"] = own_cpu_seconds()
        out[WAITED] = sum(runqueue_wait_seconds(e.pid) for e in extenders)
        return out


async def empty_namespace(api: Any, namespace: str) -> None:
    """Delete ``namespace`` with its pods and return once both are gone, so that the next phase
    starts from empty nodes."""
    await delete_namespace(api, namespace, timeout_s=DELETE_TIMEOUT_S)
    kube = RawKube(api)

    async def gone() -> bool:
        try:
            await kube.request("GET", f"/api/v1/namespaces/{namespace}")
        except NotFound:
            pods = await kube.request("GET", f"/api/v1/namespaces/{namespace}/pods", query=[("limit", "1")])
            return not pods["items"]
        return False

    await wait_for(gone, timeout=120, interval=0.2, what=f"namespace {namespace} and its pods gone")


async def placement_phase(bench: Bench, round_no: int, phase: str) -> dict[str, Any]:
    """One phase (``bare``, ``binpack`` or ``spread``) of ``bench.pods`` pods on the shared nodes."""
    api, cluster = bench.api, bench.cluster
    namespace = await create_namespace(api, prefix=f"bench-{phase.replace('+', '-')}")
    extenders: list[ExtenderProcess] = []
    plugins: DevicePlugins | None = None
    served: dict[str, int] = {}
    exit_codes: dict[int, int] = {}
    # ``<phase>+LABEL``: the phase with variant LABEL's environment in its extenders'.
    base, _, variant = phase.partition("+")
    alt_env = bench.variants.get(variant, {})
    limits = BARE_LIMITS if phase == "bare" else OUR_LIMITS
    ignored: tuple[str, ...] = ()
    try:
        target = None
        if base.startswith("binpack3"):
            extenders = await start_extender_processes(
                ELECTED_REPLICAS,
                "binpack",
                kubeconfig=Path(cluster.access.kubeconfig),
                workdir=bench.workdir / f"round-{round_no}",
                extra_args=bench.extender_args,
                extra_env=alt_env,
                replica_args=elected_args(
                    f"bench-{round_no}",
                    redirect=base in ("binpack3r", "binpack3rc", "binpack3s"),
                    cold=base in ("binpack3rc", "binpack3s"),
                ),
            )
            leader = await wait_leader(extenders)
            # binpack3s: the chart's Service selects the leader (its pod's role label).
            pinned = leader if base == "binpack3s" else next(e for e in extenders if e is not leader)
            target = pinned.url
        elif phase == "bare3res":
            ignored = (keys.RESOURCE_MEMORY, keys.RESOURCE_CORES)
        elif phase != "bare":
            extenders = await start_extender_processes(
                bench.replicas,
                base,
                kubeconfig=Path(cluster.access.kubeconfig),
                workdir=bench.workdir / f"round-{round_no}",
                extra_args=bench.extender_args,
                extra_env=alt_env,
                tls=bench.tls,
            )
            target = extenders[0].url
        tls = bench.tls if target is not None and target.startswith("https:") else None
        if target is not None and bench.device_plugins:
            hooks = bench.workdir / f"round-{round_no}" / f"hooks-{phase.replace('+', '-')}"
            plugins = await DevicePlugins.start(Path(cluster.access.kubeconfig), namespace, hooks)
        config = dataclasses.replace(scheduler_config(target, tls), ignored_resources=ignored)
        await asyncio.to_thread(cluster.start_scheduler, config, name="hami")
        if bench.backlog:
            await create_all(api, namespace, waiting_pods(bench.backlog, extender=target is not None))
        bodies = [
            gpu_pod(f"rate-{i:05d}", selector={"bench": "rate"}, limits=limits) for i in range(bench.pods)
        ]
        # The baseline once the apiserver serves nothing but this process; the counter starts there.
        before, settled_s = await quiet_apiserver(api, bench.counter)
        for e in extenders:
            favour(e.pid, bench.favour)
        bench.pin(extenders, plugins)
        gc_before: dict[str, list[float]] = {}
        if extenders:
            async with aiohttp.ClientSession() as session:
                gc_before = gc_pauses([await e.metrics(session) for e in extenders])
        cpu_before = bench.cpu(extenders, plugins)
        stop_probe = asyncio.Event()
        probe = None
        if target and bench.filter_probe:
            probe = asyncio.create_task(
                probe_filters(
                    target,
                    bench.nodes,
                    stop_probe,
                    boost=bench.favour,
                    cpus=bench.split.rest if bench.split is not None else None,
                    tls=tls,
                )
            )
        profilers = [
            await start_profiler(e.pid, bench.profile_dir / f"round-{round_no}-{phase}-{e.index}.txt")
            for e in extenders
            if bench.profile_dir is not None
        ]
        first = time.perf_counter()
        try:
            created, done = await asyncio.gather(
                create_all(api, namespace, bodies),
                wait_all(
                    api,
                    namespace,
                    {b["metadata"]["name"] for b in bodies},
                    allocated if plugins is not None else bound,
                ),
            )
        finally:
            stop_probe.set()
            for profiler in profilers:
                await stop_profiler(profiler)
        probed = await probe if probe is not None else {"wall": [], "arrival": []}
        elapsed = max(done.values()) - first
        await asyncio.sleep(SETTLE_S)  # let trailing events land before the closing scrape
        cpu_after = bench.cpu(extenders, plugins)
        after = await apiserver_requests(api)
        own = bench.counter.snapshot()
        # After the closing scrape: this list is not the phase's API work.
        placed = placement(
            (await RawKube(api).request("GET", f"/api/v1/namespaces/{namespace}/pods"))["items"]
        )
        extender_metrics: dict[str, float] = {}
        cuts: dict[str, int] = {}
        queued = 0
        connections = 0
        peak_rss = 0.0
        gc_after: dict[str, list[float]] = {}
        binds: Counter[str] = Counter()
        unwatched = 0
        waits: dict[str, int] = {}
        if extenders:
            async with aiohttp.ClientSession() as session:
                texts = [await e.metrics(session) for e in extenders]
            extender_metrics = {
                verb: histogram_mean_ms(texts, f"hamipy_extender_{verb}_duration_seconds")
                for verb in ("filter", "bind")
            }
            cuts = connection_cuts(texts)
            waited = counter_by_label(texts, "hamipy_extender_http_connections_waited", "server")
            queued = sum(waited.values())
            accepted = counter_by_label(texts, "hamipy_extender_http_connections_accepted", "server")
            connections = accepted.get("api", 0)
            peak_rss = max(rss_mib(e.pid, "VmHWM") for e in extenders)
            gc_after = gc_pauses(texts)
            binds = counter_by_label(texts, "hamipy_extender_decisions", "result", {"verb": "bind"})
            unwatched = counter_by_label(
                texts, "hamipy_extender_decisions", "verb", {"result": "fit", "reason": "UnknownPod"}
            )["filter"]
            waits = {
                s.labels["result"]: int(s.value)
                for s in family_samples(texts, "hamipy_extender_watch_wait_seconds")
                if s.name.endswith("_count")
            }
    finally:
        try:
            await asyncio.to_thread(cluster.stop_scheduler, "hami")
        finally:
            try:
                exit_codes = await stop_extenders(extenders)
                served = await plugins.stop() if plugins is not None else {}
            finally:
                await empty_namespace(api, namespace)
    rate = bench.pods / elapsed
    cpu = {k: round(cpu_after[k] - cpu_before[k], 2) for k in cpu_after if k != WAITED}
    result: dict[str, Any] = {
        "round": round_no,
        "phase": phase,
        "scheduler": f"{HAMI_SCHEDULER_NAME}"
        + (f" + {len(extenders)} extender process(es), {phase}" if extenders else ", no extender"),
        "pod_limits": dict(limits),
        "nodes": bench.nodes,
        "pods": bench.pods,
        "backlog": bench.backlog,
        "quiet_wait_s": round(settled_s, 1),
        "created_in_s": round(max(created.values()) - first, 2),
        "done_when": "allocated" if plugins is not None else "bound",
        "all_done_in_s": round(elapsed, 2),
        "pods_per_s": round(rate, 1),
        "create_to_done": percentiles_us([done[n] - created[n] for n in created]),
        "placement": placed,
        "api_requests": request_figures(before, after, own, bench.pods),
        "cpu_s": cpu,
        "cpu_ms_per_pod": cpu_per_pod(cpu, bench.pods),
        "extender_runqueue_wait_s": round(cpu_after[WAITED] - cpu_before[WAITED], 2),
    }
    if extenders:
        result["extender_mean_ms"] = extender_metrics
        result["extender_connections_cut"] = cuts
        result["extender_connections_queued"] = queued
        result["extender_connections_accepted"] = connections
        result["extender_peak_rss_mib"] = peak_rss
        # Binds the extender refused (``pod no longer fits node``...) or failed: kube-scheduler
        # retried those pods, so the phase's pods all bound all the same.
        result["binds_refused"] = binds["refused"] + binds["error"]
        # Filters that fitted a pod the extender's pod watch had not delivered (it reserved nothing
        # for them), the filter probe's own among them.
        result["filters_unwatched"] = unwatched
        # Filters that waited for the extender's pod watch to deliver their pod, by how it ended.
        result["filters_waited_for_watch"] = waits
        result["extender_gc_pauses"] = {
            generation: {
                "collections": int(n - gc_before.get(generation, [0, 0])[0]),
                "seconds": round(seconds - gc_before.get(generation, [0, 0])[1], 3),
            }
            for generation, (n, seconds) in sorted(gc_after.items())
        }
        if len(probed["wall"]) >= 2:
            result["filter_client_side_while_binding"] = {
                "samples": len(probed["wall"]),
                **percentiles_us(probed["wall"]),
                "arrival": percentiles_us(probed["arrival"]),
                "wall_s": [round(x, 6) for x in probed["wall"]],
                "arrival_s": [round(x, 6) for x in probed["arrival"]],
            }
        result["extender_exit_codes"] = list(exit_codes.values())
        if served:
            result["device_plugin_allocations"] = served
        result["extender_nice"] = -bench.favour
    if bench.split is not None:
        split = bench.split
        result["cpus"] = {
            "control_plane": sorted(split.control_plane),
            "rest": sorted(split.rest),
            "bench_beside_control_plane": split.bench_beside_control_plane,
        }
    return result


def cpu_per_pod(cpu: Mapping[str, float], pods: int) -> dict[str, float]:
    """CPU milliseconds per placed pod: the whole ``pipeline``, its ``control_plane``, and each process."""
    per_pod = {k: 1000 * cpu.get(k, 0.0) / pods for k in PIPELINE}
    per_pod["control_plane"] = sum(per_pod[k] for k in CONTROL_PLANE)
    per_pod["pipeline"] = sum(per_pod[k] for k in PIPELINE)
    return {k: round(v, 2) for k, v in per_pod.items()}


def _placement_text(phase: Mapping[str, Any]) -> str:
    """Where the phase's pods went and what the extender refused:
    ``; most per node 2, per GPU 1; binds refused 0; unwatched filters 3``."""
    placed = phase["placement"]
    text = f"; most per node {placed['most_per_node']}"
    if placed["most_per_gpu"]:
        text += f", per GPU {placed['most_per_gpu']}"
    if "binds_refused" in phase:
        text += f"; binds refused {phase['binds_refused']}; unwatched filters {phase['filters_unwatched']}"
        waits = phase.get("filters_waited_for_watch") or {}
        if any(waits.values()):
            text += "; waited for the watch " + ", ".join(f"{n} {r}" for r, n in sorted(waits.items()))
    return text


def _gc_text(pauses: Mapping[str, Mapping[str, float]]) -> str:
    """The extenders' garbage collector in a phase: ``; gc s 0.05/0.12/0.08`` (seconds held by
    generation 0, 1 and 2)."""
    if not pauses:
        return ""
    return "; gc s " + "/".join(f"{pauses[g]['seconds']:.2f}" for g in sorted(pauses))


def _ours(phases: Sequence[str]) -> list[str]:
    """Every phase but ``bare`` (``bare3res`` too: its ratio to ``bare`` is the pod shape's cost)."""
    return [ph for ph in phases if ph != "bare"]


def _vs_bare3res(phases: Sequence[str]) -> list[str]:
    """The extender phases to compare with ``bare3res`` when it ran."""
    return [ph for ph in phases if ph not in BASELINES] if "bare3res" in phases else []


def _alt_ratios(phases: Sequence[str]) -> list[str]:
    """The ``<phase>+LABEL`` phases (``--variant``), each compared with its stock twin."""
    return [ph for ph in phases if "+" in ph]


def _replica_ratios(phases: Sequence[str]) -> list[str]:
    """The elected-replica phases to compare with one replica's (``binpack``) when both ran."""
    return [ph for ph in phases if ph.startswith("binpack3") and "binpack" in phases]


def summarize(phases: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Per round the rates and ours / bare; over the rounds the medians and the API requests per pod
    of every phase pooled."""
    by = {(p["round"], p["phase"]): p for p in phases}
    names = list(dict.fromkeys(p["phase"] for p in phases))
    per_round = []
    for r in range(1, rounds + 1):
        bare = by[(r, "bare")]["pods_per_s"]
        row: dict[str, Any] = {"round": r, **{f"{ph}_pods_per_s": by[(r, ph)]["pods_per_s"] for ph in names}}
        row.update({f"{ph}_vs_bare": round(by[(r, ph)]["pods_per_s"] / bare, 3) for ph in _ours(names)})
        row.update({f"{ph}_cpu_ms_per_pod": by[(r, ph)]["cpu_ms_per_pod"]["pipeline"] for ph in names})
        bare_cpu = by[(r, "bare")]["cpu_ms_per_pod"]["pipeline"]
        row.update(
            {f"{ph}_cpu_vs_bare": round(row[f"{ph}_cpu_ms_per_pod"] / bare_cpu, 3) for ph in _ours(names)}
        )
        for ph in _alt_ratios(names):
            base = ph.partition("+")[0]
            row[f"{ph}_vs_{base}"] = round(by[(r, ph)]["pods_per_s"] / by[(r, base)]["pods_per_s"], 3)
            row[f"{ph}_cpu_vs_{base}"] = round(row[f"{ph}_cpu_ms_per_pod"] / row[f"{base}_cpu_ms_per_pod"], 3)
        for ph in _replica_ratios(names):
            row[f"{ph}_vs_binpack"] = round(by[(r, ph)]["pods_per_s"] / by[(r, "binpack")]["pods_per_s"], 3)
        for ph in _vs_bare3res(names):
            row[f"{ph}_vs_bare3res"] = round(by[(r, ph)]["pods_per_s"] / by[(r, "bare3res")]["pods_per_s"], 3)
        per_round.append(row)
    median: dict[str, Any] = {
        f"{ph}_pods_per_s": round(statistics.median(r[f"{ph}_pods_per_s"] for r in per_round), 1)
        for ph in names
    }
    ratios = [
        *(f"{ph}_cpu_ms_per_pod" for ph in names),
        *(f"{ph}_cpu_vs_bare" for ph in _ours(names)),
        *(f"{ph}_vs_bare" for ph in _ours(names)),
        *(f"{ph}_vs_binpack" for ph in _replica_ratios(names)),
        *(f"{ph}_{what}vs_{ph.partition('+')[0]}" for ph in _alt_ratios(names) for what in ("", "cpu_")),
        *(f"{ph}_vs_bare3res" for ph in _vs_bare3res(names)),
    ]
    median.update({key: round(statistics.median(r[key] for r in per_round), 3) for key in ratios})
    for ph in names:
        parts = [p["cpu_ms_per_pod"] for p in phases if p["phase"] == ph]
        median[f"{ph}_cpu_ms_per_pod_parts"] = {
            k: round(statistics.median(c[k] for c in parts), 2) for k in (*PIPELINE, "control_plane")
        }
        mine = [p["api_requests"] for p in phases if p["phase"] == ph]
        median[f"{ph}_api_requests_per_pod"] = round(statistics.median(a["per_pod"] for a in mine), 2)
        median[f"{ph}_api_requests_per_pod_excluding_bench"] = round(
            statistics.median(a["per_pod_excluding_bench"] for a in mine), 2
        )
    pooled: dict[str, Any] = {}
    for ph in names:
        mine = [p for p in phases if p["phase"] == ph]
        pods = sum(p["pods"] for p in mine)
        delta: Counter[str] = Counter()
        own: Counter[str] = Counter()
        for p in mine:
            delta.update(p["api_requests"]["delta"])
            own.update(p["api_requests"]["bench_own_by_key"])
        others = Counter({k: v - own[k] for k, v in delta.items() if v > own[k]})
        pooled[ph] = {
            "excluding_bench": {k: round(v / pods, 3) for k, v in others.most_common(8)},
            "bench_own": {k: round(v / pods, 3) for k, v in own.most_common(4)},
        }
    worst: dict[str, dict[str, int]] = {}
    for ph in names:
        mine = [p for p in phases if p["phase"] == ph]
        worst[ph] = {
            "most_per_node": max(p["placement"]["most_per_node"] for p in mine),
            "most_per_gpu": max(p["placement"]["most_per_gpu"] for p in mine),
            "binds_refused": sum(p.get("binds_refused", 0) for p in mine),
        }
    return {
        "phases": names,
        "per_round": per_round,
        "median": median,
        "placement_worst": worst,
        "api_requests_per_pod_pooled": pooled,
        "filter_client_pooled": _probes_pooled(phases, names),
    }


def _probes_pooled(phases: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per phase, the filter probe's samples of every round together: a p99 of one phase's 300-400
    samples is its fourth-slowest sample, and moves with it."""
    pooled: dict[str, Any] = {}
    for ph in names:
        probes = [p.get("filter_client_side_while_binding") or {} for p in phases if p["phase"] == ph]
        probes = [c for c in probes if "wall_s" in c]
        if probes:
            wall = [x for c in probes for x in c["wall_s"]]
            arrival = [x for c in probes for x in c["arrival_s"]]
            pooled[ph] = {"samples": len(wall), **percentiles_us(wall), "arrival": percentiles_us(arrival)}
    return pooled


def table(phases: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The compact stdout report."""
    names = summary["phases"]
    ratios = {(r["round"], ph): r[f"{ph}_vs_bare"] for r in summary["per_round"] for ph in _ours(names)}
    lines = [
        f"{'round':>5} {'phase':<10} {'pods/s':>7} {'vs bare':>7} {'done s':>7} {'p50 s':>6} {'p99 s':>6}"
        f" {'filter ms':>9} {'client p99':>10} {'bind ms':>8} {'req/pod':>7} {'-bench':>6} {'cpu ms/pod':>10}"
        "   cpu s: api etcd sched ext plugins bench; ext waited",
    ]
    for p in phases:
        ext = p.get("extender_mean_ms", {})
        ratio = ratios.get((p["round"], p["phase"]))
        latency, api, cpu = p["create_to_done"], p["api_requests"], p["cpu_s"]
        client = p.get("filter_client_side_while_binding")
        probe = f"{client['p99_us'] / 1e3:.2f}" if client and client["samples"] >= 2 else ""
        lines.append(
            f"{p['round']:>5} {p['phase']:<10} {p['pods_per_s']:>7.1f}"
            f" {'' if ratio is None else f'{ratio:.2f}':>7} {p['all_done_in_s']:>7.2f}"
            f" {latency['p50_us'] / 1e6:>6.2f} {latency['p99_us'] / 1e6:>6.2f}"
            f" {ext.get('filter', ''):>9} {probe:>10} {ext.get('bind', ''):>8}"
            f" {api['per_pod']:>7.2f} {api['per_pod_excluding_bench']:>6.2f}"
            f" {p['cpu_ms_per_pod']['pipeline']:>10.1f}"
            f"   {cpu['apiserver']:.1f} {cpu['etcd']:.1f} {cpu['scheduler']:.1f} {cpu['extender']:.1f}"
            f" {cpu['plugins']:.1f} {cpu['bench']:.1f}; {p['extender_runqueue_wait_s']:.1f}"
            + "".join(f"; cut {reason} {n}" for reason, n in p.get("extender_connections_cut", {}).items())
            + (f"; queued {p['extender_connections_queued']}" if p.get("extender_connections_queued") else "")
            + (f"; conns {n}" if (n := p.get("extender_connections_accepted")) else "")
            + (f"; peak rss {p['extender_peak_rss_mib']:.0f} MiB" if p.get("extender_peak_rss_mib") else "")
            + _gc_text(p.get("extender_gc_pauses", {}))
            + _placement_text(p)
        )
    m = summary["median"]
    replicas = "".join(
        f"; {ph} ({ELECTED_REPLICAS} replicas) / binpack: {m[f'{ph}_vs_binpack']:.2f}"
        for ph in _replica_ratios(names)
    )
    same_pods = "".join(f"; {ph} / bare3res: {m[f'{ph}_vs_bare3res']:.2f}" for ph in _vs_bare3res(names))
    same_pods += "".join(
        f"; {ph} / {(base := ph.partition('+')[0])}: pods/s {m[f'{ph}_vs_{base}']:.2f},"
        f" cpu/pod {m[f'{ph}_cpu_vs_{base}']:.2f}"
        for ph in _alt_ratios(names)
    )
    lines.append(
        "median: "
        + ", ".join(f"{ph} {m[f'{ph}_pods_per_s']:.1f} pods/s" for ph in names)
        + "; ours / bare: "
        + ", ".join(f"{ph} {m[f'{ph}_vs_bare']:.2f}" for ph in _ours(names))
        + replicas
        + same_pods
    )
    lines.append(
        "CPU ms per placed pod, median (control plane + extenders + device plugins; ext: the extenders"
        " alone; / bare: to kube-scheduler alone): "
        + ", ".join(
            f"{ph} {m[f'{ph}_cpu_ms_per_pod']:.1f} (ext {m[f'{ph}_cpu_ms_per_pod_parts']['extender']:.1f}"
            + (f", / bare {m[f'{ph}_cpu_vs_bare']:.2f})" if ph != "bare" else ")")
            for ph in names
        )
    )
    lines.append(
        "placement, all rounds (the most pods on one node, on one GPU; binds refused, summed): "
        + ", ".join(
            f"{ph} {w['most_per_node']}/{w['most_per_gpu']}; {w['binds_refused']}"
            for ph, w in summary["placement_worst"].items()
            if ph not in BASELINES
        )
    )
    lines.append(
        "API requests per placed pod (all rounds pooled; '-bench': without this process's own"
        " requests, counted at its client and subtracted per verb/resource/subresource):"
    )
    for ph, pooled in summary["api_requests_per_pod_pooled"].items():
        top = ", ".join(f"{k} {v:.2f}" for k, v in pooled["excluding_bench"].items())
        lines.append(f"  {ph:<10} -bench: {top}")
        own = ", ".join(f"{k} {v:.2f}" for k, v in pooled["bench_own"].items())
        lines.append(f"  {'':<10} bench's own (subtracted): {own}")
    if probes := summary.get("filter_client_pooled"):
        lines.append("client /filter while binding, all rounds together (ms; arrival: the answer received):")
        for ph, c in probes.items():
            arrival = c["arrival"]
            lines.append(
                f"  {ph:<10} {c['samples']} samples: p50 {c['p50_us'] / 1e3:.2f},"
                f" p99 {c['p99_us'] / 1e3:.2f}, max {c['max_us'] / 1e3:.2f};"
                f" arrival p50 {arrival['p50_us'] / 1e3:.2f},"
                f" p99 {arrival['p99_us'] / 1e3:.2f}"
            )
    return "\n".join(lines)


async def one_node(cluster: DevCluster, api: Any, pool: NodePool, workdir: Path) -> dict[str, Any]:
    await wait_for_default_service_account(api, "default")
    gpus = [FakeGpu(f"GPU-00000e2e-0000-4000-8000-{g:012x}", memory_mib=40960) for g in range(GPUS)]
    standin, plugin = gpu_node_agents(
        workdir=workdir,
        gpus=gpus,
        kubeconfig=Path(cluster.access.kubeconfig),
        native_build=ROOT / "native" / "build",
    )
    await pool.add(NodeSpec(name="bench-gpu", labels={"bench": "one-node"}), agents=(standin, plugin))
    server = await start_extender(cluster, api, Config())
    try:
        bodies = [
            gpu_pod(f"one-{i:02d}", selector={"bench": "one-node"}, limits=our_limits(4096, 10))
            for i in range(40)
        ]
        first = time.perf_counter()
        created, served = await asyncio.gather(
            create_all(api, "default", bodies),
            wait_all(
                api,
                "default",
                {b["metadata"]["name"] for b in bodies},
                allocated,
            ),
        )
    finally:
        await server.stop()
    return {
        "pods": 40,
        "gpus": GPUS,
        "all_allocated_in_s": round(max(served.values()) - first, 2),
        "create_to_allocated": percentiles_us([served[n] - created[n] for n in created]),
    }


async def run(
    nodes: int,
    pods: int,
    rounds: int,
    progress: Callable[[str], None],
    *,
    filter_probe: bool = False,
    favour: int = 0,
    split: CpuSplit | None = None,
    phases_run: Sequence[str] = PHASES,
    backlog: int = 0,
    extender_args: Sequence[str] = (),
    tls: bool = False,
    device_plugins: bool = True,
    variants: Mapping[str, Mapping[str, str]] | None = None,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="hamipy-e2e-", dir="/tmp") as tmp,
        DevCluster(ClusterSettings(), binaries=ensure_binaries()) as cluster,
    ):
        async with cluster.api_client() as api:
            bench = Bench(cluster, api, RequestCounter(api), Path(tmp) / "extenders", nodes, pods)
            bench.filter_probe, bench.favour, bench.split = filter_probe, favour, split
            bench.backlog, bench.extender_args = backlog, tuple(extender_args)
            bench.device_plugins, bench.variants = device_plugins, dict(variants or {})
            bench.profile_dir = profile_dir
            bench.tls = LoopbackPki.create(Path(tmp) / "pki") if tls else None
            async with NodePool(api, heartbeat_interval_s=HEARTBEAT_S) as pool:
                nodes_s = await add_nodes(pool, nodes)
                # kube-controller-manager's TTL controller annotates every new node, 20 a second.
                _, quiet_s = await quiet_apiserver(api, bench.counter)
                progress(
                    f"{nodes} nodes registered in {nodes_s:.1f}s, the apiserver quiet {quiet_s:.1f}s later"
                )
                phases = []
                for round_no in range(1, rounds + 1):
                    for phase in phases_run:
                        turn = [phase]
                        if phase not in BASELINES:
                            turn += [f"{phase}+{label}" for label in bench.variants]
                        shift = (round_no - 1) % len(turn)
                        for one in turn[shift:] + turn[:shift]:
                            result = await placement_phase(bench, round_no, one)
                            progress(f"round {round_no} {one}: {result['pods_per_s']} pods/s")
                            phases.append(result)
            async with NodePool(api) as pool:
                node = await one_node(cluster, api, pool, Path(tmp) / "one-node")
    summary = summarize(phases, rounds)
    m = summary["median"]
    return {
        "nodes": nodes,
        "pods": pods,
        "rounds": rounds,
        "extender_tls": tls,
        "device_plugins": device_plugins,
        "variants": {label: dict(env) for label, env in (variants or {}).items()},
        "cpu_ms_per_pod_method": (
            "CPU seconds from the first create to 1s after the last pod done, per placed pod, of the"
            " control plane (kube-apiserver, etcd, kube-scheduler, kube-controller-manager), the"
            " extenders and the simulated nodes' device plugins ('plugins': one process serving every"
            " node's Allocate writes with the device plugin's own Allocator); this process (the users)"
            " apart"
        ),
        "nodes_registered_in_s": round(nodes_s, 1),
        "nodes_settled_in_s": round(quiet_s, 1),
        "phase_names": summary["phases"],
        "median": m,
        "per_round": summary["per_round"],
        "target_pods_per_s": TARGET_PODS_PER_S,
        "met": {ph: m[f"{ph}_pods_per_s"] >= TARGET_PODS_PER_S for ph in _ours(summary["phases"])},
        "api_requests_per_pod_pooled": summary["api_requests_per_pod_pooled"],
        "filter_client_pooled": summary["filter_client_pooled"],
        "placement_worst": summary["placement_worst"],
        "api_requests_method": (
            "apiserver_request_total from the kube-apiserver's /metrics once it served nothing but"
            f" the benchmark for 1s before the first create, and {SETTLE_S:g}s after the last pod"
            " bound, summed by (verb, resource, subresource); excluding_bench subtracts the requests"
            " this benchmark process sent in that window (pod creates, polling LISTs, the simulated"
            " nodes' heartbeats), counted at its API client by the same keys; the apiserver does not"
            " count its /metrics scrapes"
        ),
        "phases": phases,
        "one_8_gpu_node_40_pods": node,
    }


def variant(text: str) -> tuple[str, dict[str, str]]:
    """``--variant``'s ``LABEL:NAME=VALUE[,NAME=VALUE]``."""
    label, _, pairs = text.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if "=" in pair)
    if not label.isalnum() or not env or len(env) != len(pairs.split(",")):
        raise argparse.ArgumentTypeError(f"want LABEL:NAME=VALUE[,NAME=VALUE], got {text!r}")
    return label, env


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2, help="bare, binpack, spread this many times")
    parser.add_argument(
        "--filter-probe",
        action="store_true",
        help="also time /filter from a client while the binds run (its own load lowers the rates)",
    )
    parser.add_argument(
        "--favour-extender",
        type=int,
        default=0,
        metavar="N",
        help="run the extenders and the filter probe at nice -N (needs root): a core of their own",
    )
    parser.add_argument(
        "--split-cpus",
        action="store_true",
        help="the control plane on half the CPUs, the extenders, the probe and the pod creation on the"
        " others, in every phase (the extender with a CPU of its own, as in a cluster)",
    )
    parser.add_argument(
        "--bench-beside-control-plane",
        action="store_true",
        help="with --split-cpus: create the pods from the control plane's CPUs, leaving the others to"
        " the extenders and the probe alone",
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=0,
        metavar="N",
        help="before each phase's burst, N pods that fit no node (a backlog waiting for GPUs, retried"
        " by kube-scheduler throughout)",
    )
    parser.add_argument(
        "--extender-args",
        default="",
        metavar="FLAGS",
        help="flags for every extender process, as one string (e.g. '--api-connections 24')",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the binpack and spread extenders serve HTTPS and demand kube-scheduler's client"
        " certificate, as the chart deploys them (the probe asks over TLS too)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=variant,
        metavar="LABEL:NAME=VALUE[,NAME=VALUE]",
        help="run each extender phase also as <phase>+LABEL with NAME=VALUE in its extenders'"
        " environment, in an order rotated by round (repeatable)",
    )
    parser.add_argument(
        "--profile-extender",
        type=Path,
        metavar="DIR",
        help="record each extender with py-spy (on PATH) while the pods are placed, into DIR"
        " (collapsed stacks; the sampling's own CPU lowers the rates)",
    )
    parser.add_argument(
        "--no-device-plugins",
        action="store_true",
        help="leave out the simulated nodes' device plugins: an extender phase's pods are done when"
        " bound, not allocated",
    )
    parser.add_argument(
        "--phases",
        type=lambda text: [ph for ph in text.split(",") if ph],
        default=list(PHASES),
        help=f"comma list of {', '.join(KNOWN_PHASES)} (bare always runs)",
    )
    args = parser.parse_args()
    unknown = [ph for ph in args.phases if ph not in KNOWN_PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; known: {', '.join(KNOWN_PHASES)}")
    if args.bench_beside_control_plane and not args.split_cpus:
        parser.error("--bench-beside-control-plane needs --split-cpus")
    if args.rounds < 1 or args.pods < 1 or args.nodes < 1:
        parser.error("--nodes, --pods and --rounds must be at least 1")
    if args.backlog < 0:
        parser.error("--backlog must be at least 0")
    if args.tls and (elected := [ph for ph in args.phases if ph.startswith("binpack3")]):
        parser.error(f"--tls covers the binpack and spread phases, not the elected replicas' {elected}")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    figures = asyncio.run(
        run(
            args.nodes,
            args.pods,
            args.rounds,
            progress,
            filter_probe=args.filter_probe,
            favour=args.favour_extender,
            split=CpuSplit.of_machine(bench_beside_control_plane=args.bench_beside_control_plane)
            if args.split_cpus
            else None,
            phases_run=["bare", *(ph for ph in args.phases if ph != "bare")],
            backlog=args.backlog,
            extender_args=shlex.split(args.extender_args),
            tls=args.tls,
            device_plugins=not args.no_device_plugins,
            variants=dict(args.variant),
            profile_dir=args.profile_extender,
        )
    )
    print(
        table(
            figures["phases"],
            {
                "phases": figures["phase_names"],
                **{
                    k: figures[k]
                    for k in (
                        "median",
                        "per_round",
                        "api_requests_per_pod_pooled",
                        "filter_client_pooled",
                        "placement_worst",
                    )
                },
            },
        )
    )
    node = figures["one_8_gpu_node_40_pods"]
    print(
        f"one 8-GPU node, 40 pods: all allocated in {node['all_allocated_in_s']}s"
        f" (create to allocated p50 {node['create_to_allocated']['p50_us'] / 1e6:.2f}s,"
        f" p99 {node['create_to_allocated']['p99_us'] / 1e6:.2f}s)"
    )
    record("e2e_placement", figures, echo=False)


if __name__ == "__main__":
    main()
