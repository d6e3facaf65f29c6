"""What the interposer costs on the real GPU: per cuLaunchKernel and per
cuMemAlloc/cuMemFree pair with no limit, and the end-to-end time of a PyTorch matmul loop and a
small training step without the interposer, with it and no limit, and with a limit of 100 %.

The figures are recorded, not asserted (speed is a benchmark's business, not a test's); what the
tests assert is that each run completes and computes the same thing whatever is preloaded."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from gpu_support import Container, Results

ROUNDS = 5  # alternated runs per set-up; medians reported

Make = Callable[..., Container]


def alternate(
    setups: dict[str, Container], *args: str, script: str = "probe.py"
) -> dict[str, list[dict[str, Any]]]:
    """Every set-up once per round, in turn, so drift (clocks, heat) falls on all alike."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in setups}
    for _ in range(ROUNDS):
        for name, c in setups.items():
            runs[name].append(c.run(script, *args))
    return runs


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def test_launch_and_allocation_cost(container: Make, gpu_results: Results) -> None:
    """ns added per launch and per alloc/free pair by the interposer with no limit."""
    setups = {"bare": container(preload=False), "interposer": container()}
    launches = alternate(setups, "launch-cost", "--count", "100000")
    allocs = alternate(setups, "malloc-cost", "--count", "2000")
    figures = {
        name: {
            "ns_per_launch": round(median(launches[name], "ns_per_launch"), 1),
            "ns_per_alloc_free": round(median(allocs[name], "ns_per_pair"), 1),
        }
        for name in setups
    }
    figures["added"] = {
        key: round(figures["interposer"][key] - figures["bare"][key], 1) for key in figures["bare"]
    }
    gpu_results.record("cost", {"driver": figures})
    assert all(r["count"] == 100000 for rs in launches.values() for r in rs), launches
    assert all(r["count"] == 2000 for rs in allocs.values() for r in rs), allocs


def test_pytorch_workloads_end_to_end(container: Make, gpu_results: Results) -> None:
    """A bf16 matmul loop and an MLP training step: bare, interposer without a limit, and with
    CUDA_DEVICE_SM_LIMIT=100 and a memory limit; same checksum and loss in every set-up."""
    setups = {
        "bare": container(preload=False),
        "interposer": container(),
        "limit_100": container({"CUDA_DEVICE_SM_LIMIT": "100", "CUDA_DEVICE_MEMORY_LIMIT_0": "16g"}),
    }
    matmul = alternate(setups, "torch-matmul", script="frameworks.py")
    train = alternate(setups, "torch-train", script="frameworks.py")
    figures: dict[str, Any] = {
        name: {
            "matmul_ms": round(median(matmul[name], "ms_per_iter"), 3),
            "train_step_ms": round(median(train[name], "ms_per_step"), 3),
        }
        for name in setups
    }
    for name in ("interposer", "limit_100"):
        figures[name]["matmul_slowdown"] = round(figures[name]["matmul_ms"] / figures["bare"]["matmul_ms"], 3)
        figures[name]["train_slowdown"] = round(
            figures[name]["train_step_ms"] / figures["bare"]["train_step_ms"], 3
        )
    gpu_results.record("cost", {"pytorch": figures})
    checksums = {r["checksum"] for rs in matmul.values() for r in rs}
    losses = {round(r["loss"], 4) for rs in train.values() for r in rs}
    assert len(checksums) == 1, checksums
    assert len(losses) == 1, losses
