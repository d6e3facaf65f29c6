"""tests/gpu's harness, kept honest without a GPU: its driver probes run here over the fake driver
under libvgpu.so (so a probe that mis-declares a driver call or misreads an answer fails in CI,
not on the rare GPU lease), its share arithmetic is checked on known samples, its report renders,
and the suite itself collects and skips cleanly, exiting 0, where there is no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "tests" / "gpu"
sys.path.insert(0, str(GPU_TESTS))  # the harness modules are scripts' siblings, not a package

from cuda_driver import ALLOCATION_PATHS  # noqa: E402
from gpu_support import Container, gpu_absent_reason, rates, tracking  # noqa: E402

pytestmark = pytest.mark.native

FAKE_GPU = 'gpu uuid=GPU-11111111-2222-4333-8444-555555555555 name="NVIDIA H100 80GB HBM3" memory=8g\n'


@pytest.fixture
def fake_container(native_build: Path, tmp_path: Path) -> Container:
    """A tests/gpu Container whose libcuda.so.1 and libnvidia-ml.so.1 are the fake driver's; a
    kernel of the probe's default shape (432 x 256 threads) takes about 1 ms there."""
    config = tmp_path / "gpus.conf"
    config.write_text("kilothread_ns = 9000\n" + FAKE_GPU)
    workdir = tmp_path / "container"
    workdir.mkdir()
    return Container(
        workdir,
        {"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m"},
        extra_env={"HAMIPY_FAKE_GPU_CONFIG": str(config), "LD_LIBRARY_PATH": str(native_build / "fake")},
    )


@pytest.mark.parametrize("path", ALLOCATION_PATHS)
def test_each_driver_path_probe_stops_at_the_limit(path: str, fake_container: Container) -> None:
    result = fake_container.run("probe.py", "alloc", path, "--chunk-mib", "128")
    assert result == {
        "path": path,
        "allocated_mib": 1024,
        "error": "CUDA_ERROR_OUT_OF_MEMORY",
        "out_of_memory": True,
        "again_after_free": True,
    }


def test_meminfo_probe_reads_the_limit_everywhere(fake_container: Container) -> None:
    info = fake_container.run("probe.py", "meminfo")
    assert info["cu_total"] == info["device_total"] == info["nvml_total"] == 1024 << 20


@pytest.mark.parametrize("how", ["plain", "ex", "coop", "graph"])
def test_every_loop_launch_path_runs_and_samples(how: str, fake_container: Container) -> None:
    result = fake_container.run("probe.py", "loop", "--seconds", "0.5", "--how", how, "--sample-s", "0.05")
    assert result["kernels"] > 0
    assert result["sms"] == 108
    assert result["grid"] == (108 if how == "coop" else 432)
    times = [t for t, _ in result["samples"]]
    assert times == sorted(times)
    assert len(times) >= 5


def test_a_limited_loop_measures_near_its_target(fake_container: Container) -> None:
    """Over the fake GPU (whose NVML samples the limiter reads), the loop at 30 % against the same
    loop unlimited: the harness's share arithmetic lands near 30."""
    unlimited = Container(fake_container.workdir.parent / "free", extra_env=fake_container.extra_env)
    unlimited.workdir.mkdir()
    args = ("loop", "--seconds", "4", "--sample-s", "0.05")
    full = unlimited.run("probe.py", *args)
    limited = Container(
        fake_container.workdir, {"CUDA_DEVICE_SM_LIMIT": "30"}, extra_env=fake_container.extra_env
    ).run("probe.py", *args)
    full_rate = max(rate for _, rate in rates(full["samples"], skip_s=1.0))
    track = tracking(limited["samples"], full_rate, 30, band=10)
    assert 15 <= track.mean_share <= 45, track


def test_share_arithmetic_on_known_samples() -> None:
    """A loop at 100 kernels/s for 2 s, then at 30/s: settles at the switch, mean 30 % of 100."""
    samples = [(t / 10, 10 * t) for t in range(21)] + [(2 + t / 10, 200 + 3 * t) for t in range(1, 61)]
    start, rate = rates(samples)[0]
    assert start == 0.0
    assert rate == pytest.approx(100.0)
    track = tracking(samples, 100.0, 30)
    assert track.settle_s == pytest.approx(2.0)
    assert track.mean_share == pytest.approx(30.0)
    assert track.mean_error == pytest.approx(0.0, abs=1e-9)


def test_report_renders_a_results_file(tmp_path: Path) -> None:
    doc = {
        "when": "2026-11-24T00:00:00Z",
        "machine": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "gpu_memory_mib": 81559,
            "driver": "580.1",
            "torch": "2.9",
        },
        "sections": {
            "memory": {"driver_malloc": {"allocated_mib": 4096, "error": "CUDA_ERROR_OUT_OF_MEMORY"}},
            "compute": {"sm_30": {"target": 30, "mean_share": 31.2, "mean_error": 1.5, "settle_s": 1.0}},
        },
    }
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(doc))
    out = subprocess.run(
        [sys.executable, str(GPU_TESTS / "report.py"), str(path), "--markdown"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "| device | NVIDIA H100 80GB HBM3 (81559 MiB) |" in out
    assert "| memory 4096m: driver_malloc | 4096 MiB then CUDA_ERROR_OUT_OF_MEMORY |" in out
    assert "| compute sm_30 | share 31.2 % (error 1.5), settle 1.0 s |" in out


@pytest.mark.skipif(gpu_absent_reason() is None, reason="a GPU is here: tests/gpu runs for real")
def test_the_suite_collects_and_skips_cleanly_without_a_gpu() -> None:
    """run.sh's pytest call, as on a bare machine: every test skipped with the reason, exit 0."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(GPU_TESTS / "pytest.ini"),
            str(GPU_TESTS),
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped" in summary, summary
    assert "passed" not in summary, summary
    assert "error" not in summary, summary
    assert "no NVIDIA GPU here" in proc.stdout
