"""A process of a GPU container, driven by the tests: one subcommand per thing to observe, one JSON
object on stdout. Run it under ``LD_PRELOAD=libvgpu.so`` with the container's limits in the
environment (tests/gpu/gpu_support.py builds that environment).

    probe.py meminfo                              what cuMemGetInfo, cuDeviceTotalMem and NVML say
    probe.py alloc PATH --chunk-mib N [--max-mib M]   allocate until refused, then free
    probe.py hold PATH --mib N                    allocate, print "ready", free when stdin closes
    probe.py loop --seconds S [--block B] [--how plain|ex|coop|graph]   the work-kernel loop
    probe.py launch-cost [--count N]              ns per empty-kernel launch
    probe.py malloc-cost [--count N]              ns per cuMemAlloc + cuMemFree pair of 1 MiB
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from typing import Any

from cuda_driver import (
    ALLOCATION_PATHS,
    ATTR_MULTIPROCESSOR_COUNT,
    Allocation,
    CudaError,
    Driver,
    kernel_params,
)

MiB = 1 << 20


def meminfo(_: argparse.Namespace) -> dict[str, Any]:
    driver = Driver()
    free, total = driver.mem_info()
    out: dict[str, Any] = {"cu_free": free, "cu_total": total, "device_total": driver.total_mem()}
    import pynvml

    pynvml.nvmlInit()
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        out |= {"nvml_total": int(info.total), "nvml_used": int(info.used), "nvml_free": int(info.free)}
    finally:
        pynvml.nvmlShutdown()
    return out


def alloc(args: argparse.Namespace) -> dict[str, Any]:
    """Chunks by one path until the driver (or the interposer) refuses or --max-mib is reached;
    then everything is freed and one chunk is asked for again (the limit gives back)."""
    driver = Driver()
    held: list[Allocation] = []
    error: CudaError | None = None
    chunk = args.chunk_mib * MiB
    while len(held) * args.chunk_mib + args.chunk_mib <= args.max_mib:
        try:
            held.append(driver.allocate(args.path, chunk))
        except CudaError as exc:
            error = exc
            break
    allocated = len(held) * args.chunk_mib
    for allocation in held:
        driver.free(allocation)
    again = True
    try:
        driver.free(driver.allocate(args.path, chunk))
    except CudaError:
        again = False
    return {
        "path": args.path,
        "allocated_mib": allocated,
        "error": error.name if error else None,
        "out_of_memory": bool(error and error.out_of_memory),
        "again_after_free": again,
    }


def hold(args: argparse.Namespace) -> dict[str, Any]:
    driver = Driver()
    try:
        allocation = driver.allocate(args.path, args.mib * MiB)
    except CudaError as exc:
        return {"held_mib": 0, "error": exc.name}
    print("ready", flush=True)
    sys.stdin.read()
    driver.free(allocation)
    return {"held_mib": args.mib, "error": None}


def loop(args: argparse.Namespace) -> dict[str, Any]:
    """The work kernel, back to back for --seconds, synchronised every --batch launches; samples
    (seconds since start, kernels done) at the first synchronisation after each --sample-s."""
    driver = Driver()
    sms = driver.attribute(ATTR_MULTIPROCESSOR_COUNT)
    grid = args.grid or sms * (1 if args.how == "coop" else 4)
    func = driver.function("work")
    params = kernel_params(ctypes.c_uint32(args.iters), ctypes.c_uint64(0))
    stream = driver.stream()
    graph = None
    per_step = args.batch
    if args.how == "graph":

        def record() -> None:
            for _ in range(args.batch):
                driver.launch(func, grid, args.block, params, stream)

        graph = driver.capture_graph(stream, record)
    samples: list[tuple[float, int]] = [(0.0, 0)]
    done = 0
    start = time.monotonic()
    end = start + args.seconds
    next_sample = start + args.sample_s
    while (now := time.monotonic()) < end:
        if graph is not None:
            driver.graph_launch(graph, stream)
        else:
            for _ in range(per_step):
                driver.launch(func, grid, args.block, params, stream, args.how)
        driver.stream_synchronize(stream)
        done += per_step
        if now >= next_sample:
            samples.append((round(time.monotonic() - start, 4), done))
            next_sample += args.sample_s
    return {
        "how": args.how,
        "block": args.block,
        "grid": grid,
        "sms": sms,
        "kernels": done,
        "samples": samples,
    }


def launch_cost(args: argparse.Namespace) -> dict[str, Any]:
    driver = Driver()
    func = driver.function("empty")
    stream = driver.stream()
    for _ in range(256):  # warm: module load, first-launch set-up
        driver.launch(func, 1, 32, None, stream)
    driver.stream_synchronize(stream)
    start = time.perf_counter_ns()
    for i in range(args.count):
        driver.launch(func, 1, 32, None, stream)
        if i % 256 == 255:
            driver.stream_synchronize(stream)
    driver.stream_synchronize(stream)
    return {"count": args.count, "ns_per_launch": (time.perf_counter_ns() - start) / args.count}


def malloc_cost(args: argparse.Namespace) -> dict[str, Any]:
    driver = Driver()
    driver.free(driver.allocate("malloc", MiB))
    start = time.perf_counter_ns()
    for _ in range(args.count):
        driver.free(driver.allocate("malloc", MiB))
    return {"count": args.count, "ns_per_pair": (time.perf_counter_ns() - start) / args.count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("meminfo").set_defaults(run=meminfo)
    p = sub.add_parser("alloc")
    p.add_argument("path", choices=ALLOCATION_PATHS)
    p.add_argument("--chunk-mib", type=int, default=256)
    p.add_argument("--max-mib", type=int, default=1 << 22)
    p.set_defaults(run=alloc)
    p = sub.add_parser("hold")
    p.add_argument("path", choices=ALLOCATION_PATHS)
    p.add_argument("--mib", type=int, required=True)
    p.set_defaults(run=hold)
    p = sub.add_parser("loop")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--grid", type=int, default=0, help="blocks (default: 4 per SM, 1 for coop)")
    p.add_argument("--iters", type=int, default=20000, help="FMAs per thread per kernel")
    p.add_argument("--batch", type=int, default=4, help="launches between synchronisations")
    p.add_argument("--how", choices=("plain", "ex", "coop", "graph"), default="plain")
    p.add_argument("--sample-s", type=float, default=0.1, help="seconds between samples")
    p.set_defaults(run=loop)
    p = sub.add_parser("launch-cost")
    p.add_argument("--count", type=int, default=100_000)
    p.set_defaults(run=launch_cost)
    p = sub.add_parser("malloc-cost")
    p.add_argument("--count", type=int, default=2_000)
    p.set_defaults(run=malloc_cost)
    args = parser.parse_args(argv)
    try:
        result = args.run(args)
    except CudaError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
