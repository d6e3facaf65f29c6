"""tests/gpu: isolation on a real NVIDIA GPU (docs/isolation.md#on-a-real-gpu-testsgpu). Every
test here is marked ``gpu`` and skipped, with the reason, where no real GPU and driver are present
(CI, laptops); on a GPU machine ``tests/gpu/run.sh`` builds native/ and runs them, and the figures
go to one JSON results file (``HAMIPY_GPU_RESULTS``, default tests/gpu/results/gpu.json) that
``report.py`` turns into a table."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpu_support import BUILD, HERE, ROOT, Container, Results, gpu_absent_reason

_ABSENT = gpu_absent_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)
            if _ABSENT:
                item.add_marker(pytest.mark.skip(reason=_ABSENT))


@pytest.fixture(scope="session")
def gpu_results() -> Iterator[Results]:
    results = Results(Path(os.environ.get("HAMIPY_GPU_RESULTS", HERE / "results" / "gpu.json")))
    yield results
    if results.sections:
        results.write(_machine())


@pytest.fixture(scope="session")
def native_build() -> Path:
    """native/ built with make against nothing but its own headers; the real driver is what the
    probes load at run time. A failed build fails the tests."""
    proc = subprocess.run(
        ["make", "-C", str(ROOT / "native")], capture_output=True, text=True, timeout=600, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"make -C native failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return BUILD


@pytest.fixture
def container(native_build: Path, tmp_path: Path) -> Any:
    """A factory: container(limits={...}, preload=True) -> Container in its own directory."""
    count = iter(range(1000))

    def make(
        limits: dict[str, str] | None = None, *, preload: bool = True, env: dict[str, str] | None = None
    ) -> Container:
        workdir = tmp_path / f"container{next(count)}"
        workdir.mkdir()
        return Container(workdir, dict(limits or {}), preload, dict(env or {}))

    return make


def _machine() -> dict[str, Any]:
    """Device, driver and CUDA versions for the results file."""
    facts: dict[str, Any] = {"python": platform.python_version(), "kernel": platform.release()}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        facts |= {
            "gpu": _text(pynvml.nvmlDeviceGetName(handle)),
            "gpu_memory_mib": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) >> 20,
            "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_api": f"{cuda // 1000}.{cuda % 1000 // 10}",
        }
        pynvml.nvmlShutdown()
    except Exception as exc:  # the results file says what could not be read
        facts["nvml_error"] = repr(exc)
    for module in ("torch", "cupy"):
        try:
            facts[module] = __import__(module).__version__
        except Exception as exc:  # recorded, not fatal
            facts[module] = f"unavailable: {exc!r}"
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30, check=False)
        facts["nvcc"] = nvcc.stdout.strip().splitlines()[-1] if nvcc.stdout.strip() else None
    except OSError:
        facts["nvcc"] = None
    return facts


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
