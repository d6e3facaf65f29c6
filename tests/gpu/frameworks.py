"""A container process that uses the frameworks (PyTorch, CuPy) rather than the driver: their
allocators, their out-of-memory errors, their CUDA graphs, and real workloads for the cost figures.
One JSON object on stdout.

    frameworks.py torch-meminfo                   torch.cuda.mem_get_info()
    frameworks.py torch-oom [--chunk-mib N]       tensors until torch.cuda.OutOfMemoryError
    frameworks.py cupy-oom PATH [--chunk-mib N]   CuPy's runtime paths until cudaErrorMemoryAllocation
    frameworks.py torch-graph                     a captured CUDA graph replays and agrees with eager
    frameworks.py torch-matmul [--iters N]        ms per bf16 4096^3 matmul, and a checksum
    frameworks.py torch-train [--steps N]         ms per training step of a small MLP, and its loss

PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True) comes from the test's environment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
CUPY_PATHS = ("malloc", "async", "pool", "managed", "array", "cupy")


def torch_meminfo(_: argparse.Namespace) -> dict[str, Any]:
    import torch

    free, total = torch.cuda.mem_get_info()
    return {
        "free": free,
        "total": total,
        "properties_total": torch.cuda.get_device_properties(0).total_memory,
    }


def torch_oom(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    held: list[Any] = []
    error = None
    try:
        while True:
            held.append(torch.empty(args.chunk_mib * MiB, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as exc:
        error = type(exc).__name__
    allocated = len(held) * args.chunk_mib
    reserved = torch.cuda.memory_reserved() // MiB
    held.clear()
    torch.cuda.empty_cache()
    again = torch.empty(args.chunk_mib * MiB, dtype=torch.uint8, device="cuda").numel() > 0
    return {"allocated_mib": allocated, "reserved_mib": reserved, "error": error, "again_after_free": again}


def cupy_oom(args: argparse.Namespace) -> dict[str, Any]:
    import cupy
    from cupy.cuda import runtime

    nbytes = args.chunk_mib * MiB
    stream = cupy.cuda.Stream(non_blocking=True)
    allocate, free = _cupy_path(args.path, nbytes, stream)
    held: list[Any] = []
    error = None
    try:
        while True:
            held.append(allocate())
            stream.synchronize()
    except (runtime.CUDARuntimeError, cupy.cuda.memory.OutOfMemoryError) as exc:
        error = type(exc).__name__ + ": " + str(exc)[:120]
    allocated = len(held) * args.chunk_mib
    for item in held:
        free(item)
    stream.synchronize()
    held.clear()
    cupy.get_default_memory_pool().free_all_blocks()
    free(allocate())
    stream.synchronize()
    return {"path": args.path, "allocated_mib": allocated, "error": error, "again_after_free": True}


def _cupy_path(path: str, nbytes: int, stream: Any) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(allocate, free) for one of CuPy's ways to the runtime's allocators."""
    import cupy
    from cupy.cuda import runtime, texture

    if path == "malloc":  # cudaMalloc
        return lambda: runtime.malloc(nbytes), runtime.free
    if path == "async":  # cudaMallocAsync (the device's current pool)
        return lambda: runtime.mallocAsync(nbytes, stream.ptr), lambda p: runtime.freeAsync(p, stream.ptr)
    if path == "pool":  # cudaMallocFromPoolAsync on the default pool
        pool = runtime.deviceGetDefaultMemPool(0)
        return (
            lambda: runtime.mallocFromPoolAsync(nbytes, pool, stream.ptr),
            lambda p: runtime.freeAsync(p, stream.ptr),
        )
    if path == "managed":  # cudaMallocManaged
        return lambda: runtime.mallocManaged(nbytes), runtime.free
    if path == "array":  # cudaMallocArray, float4 texels
        desc = texture.ChannelFormatDescriptor(32, 32, 32, 32, runtime.cudaChannelFormatKindFloat)
        width = 16384
        return lambda: texture.CUDAarray(desc, width, nbytes // (width * 16)), lambda a: None
    if path == "cupy":  # CuPy's own pool over cudaMalloc
        return lambda: cupy.empty(nbytes, dtype=cupy.uint8), lambda a: None
    raise ValueError(f"unknown CuPy path {path!r}")


def torch_graph(_: argparse.Namespace) -> dict[str, Any]:
    import torch

    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    out = torch.empty_like(a)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture, as PyTorch asks
        out.copy_(torch.relu(a @ b))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.relu(a @ b))
    replays = 20
    for _replay in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    eager = torch.relu(a @ b)
    return {"replays": replays, "agrees": bool(torch.allclose(out, eager, rtol=1e-3, atol=1e-3))}


def torch_matmul(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        c = a @ b
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {
        "iters": args.iters,
        "ms_per_iter": 1e3 * elapsed / args.iters,
        "checksum": float(c.float().sum()),
    }


def torch_train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.GELU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.GELU(),
        torch.nn.Linear(4096, 10),
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(512, 1024, device="cuda")
    y = torch.randint(0, 10, (512,), device="cuda")

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = 0.0
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"steps": args.steps, "ms_per_step": 1e3 * elapsed / args.steps, "loss": loss}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("torch-meminfo").set_defaults(run=torch_meminfo)
    p = sub.add_parser("torch-oom")
    p.add_argument("--chunk-mib", type=int, default=256)
    p.set_defaults(run=torch_oom)
    p = sub.add_parser("cupy-oom")
    p.add_argument("path", choices=CUPY_PATHS)
    p.add_argument("--chunk-mib", type=int, default=256)
    p.set_defaults(run=cupy_oom)
    sub.add_parser("torch-graph").set_defaults(run=torch_graph)
    p = sub.add_parser("torch-matmul")
    p.add_argument("--iters", type=int, default=200)
    p.set_defaults(run=torch_matmul)
    p = sub.add_parser("torch-train")
    p.add_argument("--steps", type=int, default=100)
    p.set_defaults(run=torch_train)
    args = parser.parse_args(argv)
    print(json.dumps(args.run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
