"""Benchmark: one monitor scrape of 100 GPU containers (target <= 50 ms).

Run as a script: ``.venv/bin/python tests/bench/bench_monitor.py [--containers N]``. It lays out a hook
directory like a busy node's: ``N`` containers (one per pod), each with a region file of 4 live
processes on one of 8 GPUs, and their pods with allocation annotations in the monitor's pod view;
then times ``Monitor.render()``, the whole ``/metrics`` body: directory scan, the ``pread`` reads
and seqlock checks of every region, decoding, the join with the pods, and the text exposition. Host
GPUs come from a fixed sample (NVML itself answers in microseconds per call on a real driver).
Figures: the full scrape, with legacy names too, and the region reads alone. Like ``hamipy-monitor``,
the benchmark freezes what start-up allocated (``gc.freeze``) before it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _results import percentiles_us, record, time_calls

from hamipy.monitor.gpu_samples import HostGpuSample
from hamipy.monitor.monitor import Monitor
from hamipy.monitor.settings import MonitorSettings
from hamipy.monitor.telemetry import Telemetry
from hamipy.protocol import keys
from hamipy.protocol.allocation_env import region_host_dir
from hamipy.protocol.region import MemoryUsage, ProcessUsage, build_region

TARGET_MS = 50.0
GPUS = 8
PROCS = 4
MIB = 1 << 20
NODE = "bench-gpu-node"


def gpu_uuid(i: int) -> str:
    return f"GPU-00000000-0000-4000-8000-0000000000{i:02x}"


class Pods:
    """An API server that lists ``pods`` once and whose watch never says anything (a ``KubeApi``)."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        return {"items": self.pods, "metadata": {"resourceVersion": "1"}}

    async def stream(self, path: str, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        await asyncio.Event().wait()
        yield {}


class Gpus:
    def sample(self) -> list[HostGpuSample]:
        return [
            HostGpuSample(i, gpu_uuid(i), "NVIDIA A100-SXM4-80GB", 10 << 30, 80 << 30, 50)
            for i in range(GPUS)
        ]

    def close(self) -> None:
        pass


def layout(hook: Path, containers: int) -> list[dict[str, Any]]:
    pods = []
    for i in range(containers):
        uid = f"00000000-0000-4000-8000-{i:012d}"
        uuid = gpu_uuid(i % GPUS)
        procs = [
            ProcessUsage(
                slot=s,
                pid=100 + s,
                hostpid=10_000 + 100 * i + s,
                used=(MemoryUsage(300 * MIB, 10 * MIB, 200 * MIB, 0, 510 * MIB),),
                sm_util=(5,),
            )
            for s in range(PROCS)
        ]
        directory = Path(region_host_dir(str(hook), uid, "main"))
        directory.mkdir(parents=True)
        (directory / f"{i:08x}.cache").write_bytes(
            build_region(
                uuids=[uuid], limits=[4096 * MIB], sm_limits=[25], processes=procs, last_kernel_time=1
            )
        )
        pods.append(
            {
                "metadata": {
                    "name": f"pod-{i:04d}",
                    "namespace": f"team-{i % 10}",
                    "uid": uid,
                    "resourceVersion": "1",
                    "annotations": {keys.DEVICES_ALLOCATED: f"{uuid},NVIDIA,4096,25:;"},
                },
                "spec": {"nodeName": NODE, "containers": [{"name": "main"}]},
                "status": {"phase": "Running"},
            }
        )
    return pods


def monitor(hook: Path, pods: list[dict[str, Any]], *, legacy: bool) -> Monitor:
    m = Monitor(
        settings=MonitorSettings(node_name=NODE, hook_path=hook, legacy_metrics=legacy),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=Pods(pods),
        host_gpus=Gpus(),
    )
    asyncio.run(m.pods.informer.list_once())
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=100)
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    hook = Path(tempfile.mkdtemp(prefix="hamipy-bench-monitor-"))
    try:
        pods = layout(hook, args.containers)
        plain, legacy = monitor(hook, pods, legacy=False), monitor(hook, pods, legacy=True)
        gc.collect()
        gc.freeze()  # as hamipy-monitor does once started
        body = plain.render()
        series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        used = [line for line in body.splitlines() if line.startswith(b"hami_vgpu_memory_used_bytes{")]
        if len(used) != args.containers or any(float(line.split()[-1]) != PROCS * 510 * MIB for line in used):
            raise SystemExit(f"unexpected scrape: {used[:2]}")
        scrape = percentiles_us(time_calls(plain.render, iterations=args.iterations, warmup=10))
        scrape_legacy = percentiles_us(time_calls(legacy.render, iterations=args.iterations, warmup=10))
        reads = percentiles_us(time_calls(plain.regions.read_all, iterations=args.iterations, warmup=10))
        for m in (plain, legacy):
            m.regions.close()
        record(
            "monitor_scrape",
            {
                "containers": args.containers,
                "processes_per_container": PROCS,
                "series_per_scrape": series,
                "scrape": scrape,
                "scrape_with_legacy_names": scrape_legacy,
                "region_reads_only": reads,
                "target_ms": TARGET_MS,
                "met": scrape["p99_us"] / 1000 <= TARGET_MS,
            },
        )
    finally:
        shutil.rmtree(hook, ignore_errors=True)


if __name__ == "__main__":
    main()
