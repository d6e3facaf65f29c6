"""Benchmark: the extender's memory over a long create/allocate/delete churn (target: flat).

Run as a script: ``.venv/bin/python tests/bench/bench_churn.py [--minutes 30] [--nodes 50] [--batch 200]``.

A devcluster, ``--nodes`` simulated nodes registered as our device plugin registers them (8 GPUs,
10 slots each), one extender as users run it (``hamipy-extender serve`` in its own process, binpack)
wired into the ``hami-scheduler`` kube-scheduler. Then, for ``--minutes``, cycles of: ``--batch``
pods created (1 GPU; 1,000, 2,000 or 4,000 MiB; 5 or 10 % cores; every name new), each bound by the
extender with its allocation (seen by a watch), then deleted at once (grace 0) and waited for until
gone. Every pod the extender ever saw is gone at the end of each cycle, so its model, reservations,
event series and caches should come back to the same size.

The extender's RSS (``VmRSS``) and its open connections to the API server are sampled after each
cycle (each TLS connection holds asyncio's read buffer, and the pool opens more, up to its cap of
24, as the peak of concurrent requests grows). Reported: RSS after the first cycle
(start: imports, the nodes and the watches are in) and after the last (end), the most seen, and
the least-squares slope over the run's second half in MiB per 10 minutes; with the pods churned.
A table goes to stdout, everything to ``tests/bench/results/churn_memory.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: extender_processes
sys.path.insert(0, str(Path(__file__).parent))

from urllib.parse import urlsplit

from _e2e_support import connections_to, rss_mib
from _results import record
from bench_e2e import add_nodes, create_all, gpu_pod, our_limits, scheduler_config, wait_all
from extender_processes import start_extender_processes, stop_extenders

from hamipy.devcluster import DevCluster, NodePool, create_namespace, wait_for
from hamipy.devcluster.binaries import ensure_binaries
from hamipy.devcluster.cluster import ClusterSettings
from hamipy.kube.client import RawKube

SHAPES = [our_limits(mem, cores) for mem, cores in itertools.product((1000, 2000, 4000), (5, 10))]


async def delete_all(api: Any, namespace: str) -> None:
    """Delete every pod of ``namespace`` at once (grace 0: no kubelet confirms) and wait until gone."""
    kube = RawKube(api)
    path = f"/api/v1/namespaces/{namespace}/pods"
    options = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
    await kube.request("DELETE", path, body=options, timeout_s=60)

    async def gone() -> bool:
        pods = await kube.request("GET", path, query=[("limit", "1")], timeout_s=30)
        return not pods["items"]

    await wait_for(gone, timeout=120, interval=0.2, what=f"the pods of {namespace} gone")


async def cycle(api: Any, namespace: str, number: int, batch: int) -> None:
    bodies = [
        gpu_pod(f"c{number:05d}-{i:04d}", selector={"bench": "rate"}, limits=SHAPES[i % len(SHAPES)])
        for i in range(batch)
    ]
    names = {b["metadata"]["name"] for b in bodies}
    await asyncio.gather(
        create_all(api, namespace, bodies),
        wait_all(api, namespace, names, lambda p: bool((p.get("spec") or {}).get("nodeName"))),
    )
    await delete_all(api, namespace)


def slope_mib_per_10min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) over the second half of ``samples``."""
    half = samples[len(samples) // 2 :]
    if len(half) < 2:
        return 0.0
    fit = statistics.linear_regression([t for t, _ in half], [m for _, m in half])
    return round(fit.slope * 600, 2)


async def run(minutes: float, nodes: int, batch: int, progress: Any) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="hamipy-churn-", dir="/tmp") as tmp,
        DevCluster(ClusterSettings(), binaries=ensure_binaries()) as cluster,
    ):
        async with cluster.api_client() as api, NodePool(api, heartbeat_interval_s=300) as pool:
            await add_nodes(pool, nodes)
            (extender,) = await start_extender_processes(
                1, "binpack", kubeconfig=Path(cluster.access.kubeconfig), workdir=Path(tmp)
            )
            try:
                await asyncio.to_thread(cluster.start_scheduler, scheduler_config(extender.url), name="hami")
                namespace = await create_namespace(api, prefix="bench-churn")
                started = time.monotonic()
                samples: list[tuple[float, float]] = []
                api_port = urlsplit(cluster.access.server).port or 443
                connections: list[int] = []
                number = 0
                while not samples or time.monotonic() - started < minutes * 60:
                    await cycle(api, namespace, number, batch)
                    number += 1
                    samples.append((time.monotonic() - started, rss_mib(extender.pid)))
                    connections.append(connections_to(extender.pid, api_port))
                    if number % 20 == 1:
                        elapsed = samples[-1][0] / 60
                        progress(
                            f"{elapsed:5.1f} min, {number} cycles: extender RSS {samples[-1][1]:.1f} MiB,"
                            f" {connections[-1]} connections to the API server"
                        )
            finally:
                await asyncio.to_thread(cluster.stop_scheduler, "hami")
                await stop_extenders([extender])
    rss = [m for _, m in samples]
    return {
        "minutes": round(samples[-1][0] / 60, 1),
        "nodes": nodes,
        "batch": batch,
        "cycles": number,
        "pods_churned": number * batch,
        "rss_mib": {
            "start": rss[0],
            "end": rss[-1],
            "max": max(rss),
            "slope_second_half_mib_per_10min": slope_mib_per_10min(samples),
        },
        "api_connections": {"start": connections[0], "end": connections[-1], "max": max(connections)},
        "rss_samples": [(round(t, 1), m) for t, m in samples],
        "api_connection_samples": connections,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--batch", type=int, default=200, help="pods created, bound and deleted a cycle")
    args = parser.parse_args()
    if args.minutes <= 0 or args.nodes < 1 or not 1 <= args.batch <= args.nodes * 80:
        parser.error(
            "--minutes must be positive, --nodes at least 1, --batch within the nodes' 80 slots each"
        )

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    figures = asyncio.run(run(args.minutes, args.nodes, args.batch, progress))
    rss, conns = figures["rss_mib"], figures["api_connections"]
    print(
        f"| minutes | cycles | pods churned | extender RSS start / end / max (MiB) | slope, 2nd half |"
        f" API connections start / end / max |\n"
        f"|---|---|---|---|---|---|\n"
        f"| {figures['minutes']} | {figures['cycles']} | {figures['pods_churned']} |"
        f" {rss['start']} / {rss['end']} / {rss['max']} |"
        f" {rss['slope_second_half_mib_per_10min']:+} MiB / 10 min |"
        f" {conns['start']} / {conns['end']} / {conns['max']} |"
    )
    record("churn_memory", figures, echo=False)


if __name__ == "__main__":
    main()
