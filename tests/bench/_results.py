"""Benchmarks print their figures and write them to tests/bench/results/<name>.json.

Targets are reported next to the measured values (``met``) but never asserted: a benchmark on a
busy 2-core machine is information, not a pass/fail gate.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"


def percentiles_us(samples_s: list[float]) -> dict[str, float]:
    """p50/p99/max in microseconds of per-call durations given in seconds."""
    ordered = sorted(samples_s)
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "p50_us": round(q[49] * 1e6, 2),
        "p99_us": round(q[98] * 1e6, 2),
        "max_us": round(ordered[-1] * 1e6, 2),
    }


def time_calls(fn: Callable[[], object], *, iterations: int, warmup: int = 100) -> list[float]:
    """Durations in seconds of `iterations` calls of `fn` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    clock = time.perf_counter
    for _ in range(iterations):
        start = clock()
        fn()
        samples.append(clock() - start)
    return samples


def record(name: str, figures: dict[str, Any], *, echo: bool = True) -> Path:
    """Print `figures` (unless not `echo`: the caller printed its own summary) and write them, with
    the machine they ran on, to results/<name>.json."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "figures": figures,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"== {name}")
    if echo:
        for key, value in figures.items():
            print(f"  {key}: {value}")
    print(f"  (written to {path})")
    return path
