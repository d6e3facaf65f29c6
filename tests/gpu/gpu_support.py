"""Helpers for tests/gpu: find the real GPU, run probe processes as a container's processes under
``LD_PRELOAD=libvgpu.so``, and turn the work-loop samples into shares of the GPU.

Imported by the tests and by tests/native/test_gpu_harness.py (which runs the same probes
over the fake driver in CI), so nothing here needs a GPU to import.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUILD = ROOT / "native" / os.environ.get("HAMIPY_NATIVE_BUILD", "build")
MiB = 1 << 20
PROBE_TIMEOUT_S = 300


def gpu_absent_reason() -> str | None:
    """Why there is no real NVIDIA GPU to test on, or None when there is one. Checked without
    loading anything into this process when the device nodes are missing (CI's case)."""
    if not Path("/dev/nvidiactl").exists():
        return "no NVIDIA GPU here (/dev/nvidiactl is missing); on a GPU machine run tests/gpu/run.sh"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"the NVIDIA driver's libcuda.so.1 cannot be loaded: {exc}"
    if "native/build" in _loaded_path("libcuda.so.1"):
        return "libcuda.so.1 resolves to native/'s fake driver; unset LD_LIBRARY_PATH to test the real one"
    count = ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return "the NVIDIA driver is loaded but reports no usable GPU (cuInit or cuDeviceGetCount failed)"
    return None


def _loaded_path(soname: str) -> str:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ""
    return next((line.split()[-1] for line in maps.splitlines() if soname in line), "")


@dataclass
class Container:
    """The processes of one GPU container: one region file, one set of limits."""

    workdir: Path
    limits: dict[str, str] = field(default_factory=dict)
    preload: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "LD_PRELOAD"))}
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(self.workdir / "vgpu.cache")
        env.update(self.limits)
        env.update(self.extra_env)
        if self.preload:
            env["LD_PRELOAD"] = str(BUILD / "libvgpu.so")
        return env

    def command(self, script: str, *args: str) -> list[str]:
        return [sys.executable, str(HERE / script), *args]

    def run(self, script: str, *args: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Runs `script args` to completion and returns its JSON answer; a crash or an answer that
        is not JSON fails with the process's output."""
        proc = subprocess.run(
            self.command(script, *args),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
        return answer(proc.returncode, proc.stdout, proc.stderr, f"{script} {' '.join(args)}")

    def start(self, script: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(script, *args),
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def answer(returncode: int, stdout: str, stderr: str, what: str) -> dict[str, Any]:
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    try:
        result: dict[str, Any] = json.loads(last)
    except json.JSONDecodeError:
        raise AssertionError(
            f"{what}: exit {returncode}, no JSON answer\nstdout:\n{stdout}\nstderr:\n{stderr}"
        ) from None
    if returncode != 0:
        raise AssertionError(f"{what}: exit {returncode}: {result}\nstderr:\n{stderr[-4000:]}")
    return result


def finish(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    """Closes stdin (a holder frees and exits), reaps the process and returns its answer."""
    out, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
    return answer(proc.returncode, out, err, what)


class Results:
    """The suite's figures by section, written as JSON when the session ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sections: dict[str, Any] = {}

    def record(self, section: str, data: dict[str, object]) -> None:
        self.sections.setdefault(section, {}).update(data)

    def write(self, machine: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "suite": "tests/gpu",
            "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine,
            "sections": self.sections,
        }
        self.path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


# ---- the work loop's samples as shares of the GPU


def rates(
    samples: Sequence[Sequence[float]], window_s: float = 1.0, skip_s: float = 0.0
) -> list[tuple[float, float]]:
    """(window start, kernels per second) over consecutive windows of about `window_s`, from the
    first sample at or after `skip_s`."""
    points = [(float(t), float(n)) for t, n in samples if t >= skip_s]
    out: list[tuple[float, float]] = []
    i = 0
    for j in range(1, len(points)):
        if points[j][0] - points[i][0] >= window_s:
            out.append((points[i][0], (points[j][1] - points[i][1]) / (points[j][0] - points[i][0])))
            i = j
    return out


@dataclass(frozen=True)
class Tracking:
    """How a limited loop followed its target, in points of the unlimited rate."""

    target: float
    mean_share: float
    mean_error: float
    settle_s: float | None

    def as_dict(self) -> dict[str, float | None]:
        return {
            "target": self.target,
            "mean_share": round(self.mean_share, 1),
            "mean_error": round(self.mean_error, 1),
            "settle_s": None if self.settle_s is None else round(self.settle_s, 1),
        }


def tracking(
    samples: Sequence[Sequence[float]], unlimited_rate: float, target: float, band: float = 5.0
) -> Tracking:
    """Settle time: the start of the first window from which every window stays within `band`
    points of `target`; mean share and mean |error| over the windows after settling (or over the
    second half when it never settles)."""
    windows = [(t, 100.0 * rate / unlimited_rate) for t, rate in rates(samples)]
    if not windows:
        raise AssertionError(f"too few samples to measure: {list(samples)[:5]}...")
    settle: float | None = None
    for k, (t, _) in enumerate(windows):
        if all(abs(share - target) <= band for _, share in windows[k:]):
            settle = t
            break
    steady = [share for t, share in windows if settle is not None and t >= settle] or [
        share for _, share in windows[len(windows) // 2 :]
    ]
    return Tracking(
        target=target,
        mean_share=statistics.fmean(steady),
        mean_error=statistics.fmean(abs(share - target) for share in steady),
        settle_s=settle,
    )


def steady_rate(samples: Sequence[Sequence[float]], skip_s: float = 1.0) -> float:
    """Kernels per second after `skip_s` (start-up: module load, clocks ramping)."""
    points = [(float(t), float(n)) for t, n in samples if t >= skip_s]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        raise AssertionError(f"too few samples after {skip_s} s to measure a rate")
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
