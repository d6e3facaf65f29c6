"""Benchmark: extender ``/filter`` latency (targets: p99 <= 2 ms in-process and <= 5 ms over HTTP at
1,000 nodes x 8 GPUs with 10,000 running GPU pods; <= 10 ms over HTTP at 5,000 nodes).

Run as a script: ``.venv/bin/python tests/bench/bench_extender.py [--iterations N] [--nodes 1000]``.

The model is fed the way the watch feeds it (Node and Pod JSON with real register and allocation
annotations); each node runs 10 pods (1 GPU, 1-4 GiB, 0-30 % cores). The filtered pod asks
1 GPU / 2 GiB / 20 % with nodeCacheCapable ``NodeNames`` listing every node (kube-scheduler sends at
most the feasible nodes it found, fewer above 100 nodes with the adaptive percentageOfNodesToScore,
so this is the worst case). "in-process" is ``Scheduler.filter`` on the decoded ExtenderArgs
(decision, reservation, span, metrics, event queueing; the reservation is dropped after each call so
every call sees the same cluster); "HTTP" is a POST to a local aiohttp server from an aiohttp client
(JSON encode/decode both ways included). A "no node fits" case is reported too: it explains every
node, the slow path a pod that fits nowhere takes ("first": nothing explained before; else the same
pod again, its nodes unchanged, as kube-scheduler retries it); and "cores taken", half the nodes with 90 % of
each GPU's cores used (binpack ranks them first, the pod fits none of them), with how many nodes a
filter fitted.

Every node publishes pair scores as the fake driver's ``pcie-pairs8`` makes them (GPUs 2k and 2k+1
bridged). "topology" is a 2-GPU topology-aware pod against the same pod under plain spread,
their calls alternated in one run; "topology search" times the search alone on 16 candidates for
each count of GPUs asked (exact up to ``EXACT_PAIRS`` pair reads, greedy beyond).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import io
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import aiohttp
import msgspec
from _results import percentiles_us, record, time_calls

from hamipy.extender.explanations import Explanations
from hamipy.extender.extender_args import ExtenderArgs
from hamipy.extender.filtering import build_ask, decide
from hamipy.extender.model import PodUid, now_epoch
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.extender.topology import pick_gpus
from hamipy.kube.client import NullKube
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import ContainerDevice, DeviceInfo
from hamipy.protocol.kube_objects import plain
from hamipy.protocol.node_devices import encode_node_devices
from hamipy.protocol.node_scores import NodeScores, encode_node_scores
from hamipy.protocol.pod_devices import encode_pod_devices

GPUS = 8
PODS_PER_NODE = 10
TARGETS_US = {"in_process_1000": 2000.0, "http_1000": 5000.0, "http_5000": 10000.0}


def pcie_pairs(uuids: list[str]) -> NodeScores:
    """Pair scores as ``pcie-pairs8`` makes them: bridged pairs 1250, NODE 20 within a NUMA node
    (GPUs 0-3, 4-7), SYS 10 across."""
    return {
        a: {b: 1250 if j == i ^ 1 else 20 if i // 4 == j // 4 else 10 for j, b in enumerate(uuids) if j != i}
        for i, a in enumerate(uuids)
    }


def node_json(i: int) -> dict[str, Any]:
    devices = [
        DeviceInfo(f"GPU-{i:05d}-{g}", g, 10, 32768, 100, "NVIDIA-A100-SXM4-40GB", g // 4, "hami-core", True)
        for g in range(GPUS)
    ]
    return {
        "metadata": {
            "name": f"node-{i:05d}",
            "annotations": {
                keys.NODE_REGISTER: encode_node_devices(devices),
                keys.NODE_SCORE: encode_node_scores(pcie_pairs([d.id for d in devices])),
            },
        },
        "status": {"allocatable": {keys.RESOURCE_COUNT: str(GPUS * 10)}},
    }


def running_pod(node: int, j: int, rng: random.Random) -> dict[str, Any]:
    dev = ContainerDevice(
        f"GPU-{node:05d}-{rng.randrange(GPUS)}",
        "NVIDIA",
        rng.randint(1, 4) * 1024,
        rng.choice((0, 10, 20, 30)),
    )
    return {
        "metadata": {
            "name": f"run-{node}-{j}",
            "namespace": "work",
            "uid": f"uid-{node}-{j}",
            "annotations": {
                keys.DEVICES_ALLOCATED: encode_pod_devices([[dev]]),
                keys.VGPU_NODE: f"node-{node:05d}",
            },
        },
        "spec": {"nodeName": f"node-{node:05d}", "containers": [{"name": "main"}]},
        "status": {"phase": "Running"},
    }


def pending_pod(
    mem: str = "2048", uid: str = "uid-new", *, gpus: int = 1, policy: str | None = None
) -> dict[str, Any]:
    limits = {keys.RESOURCE_COUNT: str(gpus), keys.RESOURCE_MEMORY: mem, keys.RESOURCE_CORES: "20"}
    annotations = {keys.GPU_SCHEDULER_POLICY: policy} if policy else {}
    return {
        "metadata": {"name": uid, "namespace": "work", "uid": uid, "annotations": annotations},
        "spec": {
            "schedulerName": "hami-scheduler",
            "containers": [
                {"name": "main", "image": "app:1", "resources": {"limits": limits, "requests": limits}}
            ],
        },
        "status": {"phase": "Pending"},
    }


def build(nodes: int) -> ExtenderServer:
    server = ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=NullKube(),
    )
    rng = random.Random(7)
    began = time.perf_counter()
    server.model.replace_nodes(node_json(i) for i in range(nodes))
    server.model.replace_pods(running_pod(i, j, rng) for i in range(nodes) for j in range(PODS_PER_NODE))
    # The filtered pods as the pod watch delivers them: the filter reserves only for pods it has seen.
    server.model.apply_pod("ADDED", pending_pod())
    server.model.apply_pod("ADDED", pending_pod(mem="40000", uid="uid-nofit"))
    for uid, policy in TOPOLOGY_PODS.items():
        server.model.apply_pod("ADDED", pending_pod(uid=uid, gpus=2, policy=policy))
    gc.collect()
    gc.freeze()  # as the watcher does after each list
    print(f"model of {nodes} nodes, {nodes * PODS_PER_NODE} pods built in {time.perf_counter() - began:.2f}s")
    return server


def in_process(server: ExtenderServer, args: ExtenderArgs, iterations: int) -> list[float]:
    scheduler = server.scheduler
    model = server.model

    def call() -> None:
        scheduler.filter(args)
        model.release(PodUid("uid-new"))

    return time_calls(call, iterations=iterations, warmup=50)


TOPOLOGY_PODS = {"uid-topology": "topology-aware", "uid-spread": "spread"}


def topology_vs_spread(server: ExtenderServer, names: list[str], iterations: int) -> dict[str, Any]:
    """The 2-GPU topology-aware pod and the same pod under spread, filtered in turn (each call's
    reservation dropped), so both see the same cluster and the same machine load."""
    scheduler, model = server.scheduler, server.model
    calls = {
        policy: msgspec.convert(
            {"Pod": pending_pod(uid=uid, gpus=2, policy=policy), "NodeNames": names}, ExtenderArgs
        )
        for uid, policy in TOPOLOGY_PODS.items()
    }
    uids = {policy: PodUid(uid) for uid, policy in TOPOLOGY_PODS.items()}
    samples: dict[str, list[float]] = {policy: [] for policy in calls}
    clock = time.perf_counter
    for i in range(iterations + 50):
        for policy, args in calls.items():
            start = clock()
            assert scheduler.filter(args)["NodeNames"], policy
            took = clock() - start
            model.release(uids[policy])
            if i >= 50:
                samples[policy].append(took)
    return {policy: percentiles_us(times) for policy, times in samples.items()}


def topology_search(iterations: int) -> dict[str, Any]:
    """``pick_gpus`` alone over 16 candidates (8 bridged pairs), per count of GPUs asked."""
    uuids = [f"GPU-{g}" for g in range(16)]
    scores = pcie_pairs(uuids)
    return {
        f"{count}_of_16": percentiles_us(
            time_calls(functools.partial(pick_gpus, uuids, count, scores), iterations=iterations, warmup=10)
        )
        for count in (1, 2, 3, 4, 8, 12, 14)
    }


def filter_cold(server: ExtenderServer, args: ExtenderArgs) -> None:
    """A filter with nothing explained before (``Scheduler.explanations`` empty)."""
    server.scheduler.explanations = Explanations()
    server.scheduler.filter(args)


def cores_taken(server: ExtenderServer, args: ExtenderArgs, iterations: int) -> dict[str, Any]:
    """The filter once half the nodes have 90 % of every GPU's cores taken, slots and memory left:
    binpack ranks those first, and the pod's 20 % fits none of them. Reports how many nodes a
    filter fitted (the summary check skips them unfitted when it knows each node's freest cores)."""
    names = list(server.model.nodes)
    for i, name in enumerate(names[: len(names) // 2]):
        for g in range(GPUS):
            dev = ContainerDevice(f"GPU-{i:05d}-{g}", "NVIDIA", 1024, 90)
            server.model.apply_pod(
                "ADDED",
                {
                    "metadata": {
                        "name": f"busy-{i}-{g}",
                        "namespace": "work",
                        "uid": f"uid-busy-{i}-{g}",
                        "annotations": {keys.DEVICES_ALLOCATED: encode_pod_devices([[dev]])},
                    },
                    "spec": {"nodeName": name, "containers": [{"name": "main"}]},
                    "status": {"phase": "Running"},
                },
            )
    ask = build_ask(plain(args.pod), server.config)
    decision = decide(server.model, ask, args.node_names or [], now=now_epoch())
    assert decision.node is not None
    assert decision.node not in names[: len(names) // 2]
    figures: dict[str, Any] = percentiles_us(in_process(server, args, iterations))
    figures["nodes_fitted"] = decision.fitted
    return figures


async def over_http(server: ExtenderServer, args: ExtenderArgs, iterations: int) -> list[float]:
    body = msgspec.json.encode(args)
    await server.start()
    samples = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            url = server.url + "/filter"
            for i in range(iterations + 50):
                start = time.perf_counter()
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    answer = await resp.json()
                if i >= 50:
                    samples.append(time.perf_counter() - start)
                assert answer["NodeNames"] is not None
                server.model.release(PodUid("uid-new"))
    finally:
        await server.stop()
    return samples


async def scrape(server: ExtenderServer, iterations: int) -> dict[str, float]:
    """``/metrics`` (registry plus the GPU gauges of the whole model) fetched over HTTP from the
    extender's own app, which renders it on its event loop in steps and writes it in chunks: the
    CPU per scrape (the client's reading included, in this process), and the longest the loop went
    without running anything else (what a filter arriving mid-scrape waits at most)."""
    longest = 0.0
    rendering = True

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while rendering:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    await server.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def get() -> tuple[int, int]:
                # Read as it comes, never joined: a 10 MB join here would be this client's hold
                # of the loop, not the extender's. Returns (bytes, samples).
                size = samples = 0
                last = b"\n"
                async with session.get(server.url + "/metrics") as resp:
                    async for chunk in resp.content.iter_any():
                        size += len(chunk)
                        samples += chunk.count(b"\n") - (last[-1:] + chunk).count(b"\n#")
                        last = chunk
                return size, samples

            await get()  # warm
            ticking = asyncio.create_task(ticker())
            cpu = time.process_time()
            for _ in range(iterations):
                size, samples = await get()
            cpu = (time.process_time() - cpu) / iterations
            rendering = False
            await ticking
    finally:
        await server.stop()
    return {
        "cpu_ms_per_scrape": round(cpu * 1000, 1),
        "longest_loop_hold_ms": round(longest * 1000, 2),
        "body_mb": round(size / 1e6, 1),
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--nodes", type=int, action="append", help="node counts (default 1000 and 5000)")
    opts = parser.parse_args()
    figures: dict[str, Any] = {}
    for nodes in opts.nodes or (1000, 5000):
        server = build(nodes)
        names = [f"node-{i:05d}" for i in range(nodes)]
        args = msgspec.convert({"Pod": pending_pod(), "NodeNames": names}, ExtenderArgs)
        chosen = server.scheduler.filter(args)["NodeNames"]
        server.model.release(PodUid("uid-new"))
        assert chosen, "the benchmark pod must fit"
        proc = percentiles_us(in_process(server, args, opts.iterations))
        nofit_args = msgspec.convert(
            {"Pod": pending_pod(mem="40000", uid="uid-nofit"), "NodeNames": names}, ExtenderArgs
        )
        nofit = percentiles_us(
            time_calls(functools.partial(server.scheduler.filter, nofit_args), iterations=50, warmup=5)
        )
        nofit_first = percentiles_us(
            time_calls(functools.partial(filter_cold, server, nofit_args), iterations=20, warmup=2)
        )
        http = percentiles_us(asyncio.run(over_http(server, args, opts.iterations)))
        figures[f"in_process_{nodes}"] = proc
        figures[f"http_{nodes}"] = http
        figures[f"no_fit_in_process_{nodes}"] = nofit
        figures[f"no_fit_first_in_process_{nodes}"] = nofit_first
        figures[f"scrape_{nodes}"] = asyncio.run(scrape(server, 5))
        figures[f"cores_taken_in_process_{nodes}"] = cores_taken(server, args, opts.iterations)
        figures[f"topology_in_process_{nodes}"] = topology_vs_spread(server, names, opts.iterations)
    figures["topology_search"] = topology_search(min(opts.iterations, 500))
    for key, target in TARGETS_US.items():
        if key in figures:
            figures[key]["target_p99_us"] = target
            figures[key]["met"] = figures[key]["p99_us"] <= target
    figures["setup"] = {
        "gpus_per_node": GPUS,
        "running_pods_per_node": PODS_PER_NODE,
        "iterations": opts.iterations,
        "node_names_sent": "all nodes",
    }
    record("extender_filter", figures)


if __name__ == "__main__":
    main()
