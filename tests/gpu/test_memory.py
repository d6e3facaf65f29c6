"""Memory isolation on the real GPU: under CUDA_DEVICE_MEMORY_LIMIT_0 every
allocation path stops at the limit with the framework's own out-of-memory error, the process sees
a GPU of the limit's size through CUDA, NVML and PyTorch, the processes of one container share
the limit, and tiny and huge limits and CUDA graphs behave."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from cuda_driver import ALLOCATION_PATHS
from frameworks import CUPY_PATHS
from gpu_support import Container, MiB, Results, finish

LIMIT_MIB = 4096
LIMITED = {"CUDA_DEVICE_MEMORY_LIMIT_0": f"{LIMIT_MIB}m"}
# The interposer counts what the process allocates, not the driver's own context memory, so a
# path reaches the limit less one chunk at most.
FLOOR_MIB = LIMIT_MIB - 512

Make = Callable[..., Container]


def test_a_limited_process_sees_a_gpu_of_the_limit(container: Make, gpu_results: Results) -> None:
    """cuMemGetInfo, cuDeviceTotalMem, NVML and torch.cuda.mem_get_info all say 4 GiB."""
    c = container(LIMITED)
    driver = c.run("probe.py", "meminfo")
    torch = c.run("frameworks.py", "torch-meminfo")
    gpu_results.record("memory", {"meminfo_4096m": {"driver": driver, "torch": torch}})
    limit = LIMIT_MIB * MiB
    assert driver["cu_total"] == driver["device_total"] == driver["nvml_total"] == limit, driver
    assert 0 < driver["cu_free"] <= limit, driver
    assert driver["nvml_used"] + driver["nvml_free"] == limit, driver
    assert torch["total"] == limit, torch
    assert 0 < torch["free"] <= limit, torch


@pytest.mark.parametrize("path", ALLOCATION_PATHS)
def test_each_driver_path_stops_at_the_limit(path: str, container: Make, gpu_results: Results) -> None:
    """cuMemAlloc, pitch, managed, async (stream-ordered pool), cuMemCreate (VMM) and arrays: OOM
    at the limit, never past it, and the memory comes back after the frees."""
    result = container(LIMITED).run("probe.py", "alloc", path, "--chunk-mib", "256")
    gpu_results.record("memory", {f"driver_{path}": result})
    assert result["out_of_memory"], result
    assert FLOOR_MIB <= result["allocated_mib"] <= LIMIT_MIB, result
    assert result["again_after_free"], result


@pytest.mark.parametrize("path", CUPY_PATHS)
def test_each_cupy_path_raises_its_out_of_memory(path: str, container: Make, gpu_results: Results) -> None:
    """The runtime's cudaMalloc, cudaMallocAsync, cudaMallocFromPoolAsync, cudaMallocManaged,
    cudaMallocArray and CuPy's pool: CuPy's own error at the limit."""
    result = container(LIMITED).run("frameworks.py", "cupy-oom", path)
    gpu_results.record("memory", {f"cupy_{path}": result})
    error = result["error"] or ""
    assert "OutOfMemory" in error or "MemoryAllocation" in error, result
    assert FLOOR_MIB <= result["allocated_mib"] <= LIMIT_MIB, result


@pytest.mark.parametrize("expandable", [False, True], ids=["caching", "expandable_segments"])
def test_pytorch_allocator_raises_out_of_memory(
    expandable: bool, container: Make, gpu_results: Results
) -> None:
    """PyTorch's caching allocator, with and without expandable segments (cuMemCreate + map)."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if expandable else {}
    result = container(LIMITED, env=env).run("frameworks.py", "torch-oom")
    gpu_results.record("memory", {f"torch_{'expandable' if expandable else 'caching'}": result})
    assert result["error"] == "OutOfMemoryError", result
    assert FLOOR_MIB <= result["allocated_mib"] <= LIMIT_MIB, result
    assert result["reserved_mib"] <= LIMIT_MIB, result
    assert result["again_after_free"], result


def test_two_processes_of_one_container_share_the_limit(container: Make, gpu_results: Results) -> None:
    """One process holds 3 GiB; the other gets at most the 1 GiB left, and all 4 once it lets go."""
    c = container(LIMITED)
    holder = c.start("probe.py", "hold", "malloc", "--mib", "3072")
    assert holder.stdout is not None
    line = holder.stdout.readline().strip()
    assert line == "ready", (
        f"the holder did not allocate: {line!r} {holder.stderr.read() if holder.stderr else ''}"
    )
    try:
        second = c.run("probe.py", "alloc", "malloc", "--chunk-mib", "128")
    finally:
        held = finish(holder, "hold")
    after = c.run("probe.py", "alloc", "malloc", "--chunk-mib", "128")
    gpu_results.record(
        "memory", {"two_processes": {"second_while_held": second, "after": after, "holder": held}}
    )
    assert second["out_of_memory"], second
    assert second["allocated_mib"] <= LIMIT_MIB - 3072, second
    assert after["allocated_mib"] >= FLOOR_MIB, after


def test_a_tiny_limit_behaves(container: Make, gpu_results: Results) -> None:
    """64 MiB: the process starts, sees 64 MiB, and allocations stop there."""
    c = container({"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"})
    info = c.run("probe.py", "meminfo")
    result = c.run("probe.py", "alloc", "malloc", "--chunk-mib", "8")
    gpu_results.record("memory", {"tiny_64m": {"meminfo": info, "alloc": result}})
    assert info["cu_total"] == info["nvml_total"] == 64 * MiB, info
    assert result["out_of_memory"], result
    assert 0 < result["allocated_mib"] <= 64, result


def test_a_limit_larger_than_the_gpu_is_the_gpu(container: Make, gpu_results: Results) -> None:
    """A limit past the GPU's memory: the real size is reported, and the driver's own OOM ends it."""
    real = container(preload=False).run("probe.py", "meminfo")
    c = container({"CUDA_DEVICE_MEMORY_LIMIT_0": "4096g"})
    info = c.run("probe.py", "meminfo")
    result = c.run("probe.py", "alloc", "malloc", "--chunk-mib", "1024")
    gpu_results.record("memory", {"huge_limit": {"meminfo": info, "alloc": result}})
    assert info["cu_total"] == real["cu_total"], (info, real)
    assert info["nvml_total"] == real["nvml_total"], (info, real)
    assert result["out_of_memory"], result
    assert result["allocated_mib"] <= real["cu_total"] // MiB, result
    assert result["again_after_free"], result


def test_cuda_graphs_run_under_a_limit(container: Make, gpu_results: Results) -> None:
    """A PyTorch CUDA graph captured and replayed inside a limited container computes what eager does."""
    result: dict[str, Any] = container(LIMITED).run("frameworks.py", "torch-graph")
    gpu_results.record("memory", {"torch_graph": result})
    assert result["replays"] == 20, result
    assert result["agrees"], result
