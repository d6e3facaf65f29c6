"""Helpers for the native tests: run native/'s programs as processes of a
simulated container (a fake GPU configuration, a region file, limits in the environment or in a
limits file beside the interposer, as the device plugin mounts it) under LD_PRELOAD=libvgpu.so
over the fake driver.

HAMIPY_NATIVE_BUILD=build-asan runs the same tests against `make -C native asan`.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
BUILD_NAME = os.environ.get("HAMIPY_NATIVE_BUILD", "build")
BUILD = NATIVE / BUILD_NAME
MiB = 1024 * 1024
GiB = 1024 * MiB

GPU0_UUID = "GPU-11111111-2222-4333-8444-555555555555"
GPU1_UUID = "GPU-11111111-2222-4333-8444-666666666666"
TWO_GPUS = (
    f'gpu uuid={GPU0_UUID} name="NVIDIA A100-SXM4-80GB" memory=1g numa=1 pci=00000000:3B:00.0\n'
    f'gpu uuid={GPU1_UUID} name="NVIDIA H100 80GB HBM3" memory=2g numa=0 pci=00000000:86:00.0\n'
)
RUN_TIMEOUT_S = 30


@dataclass
class Container:
    """The processes of one simulated container: same region file, same limits, same fake GPUs."""

    build: Path
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def region_path(self) -> Path:
        return Path(self.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])

    def command(self, program: str, *args: str) -> list[str]:
        return [str(self.build / "tests" / program), *args]

    def run(
        self, program: str, *args: str, extra_env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(program, *args),
            env={**self.env, **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )

    def popen(self, program: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(program, *args),
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


ContainerFactory = Callable[..., Container]


def new_container(
    build: Path,
    workdir: Path,
    *,
    limits: Mapping[str, str] | None = None,
    gpus: str = TWO_GPUS,
    extra_config: str = "",
    preload: bool = True,
    limits_file: str | None = None,
) -> Container:
    """A container in `workdir` (created): its fake GPU configuration, region path and environment.
    ``limits_file`` (its text): the interposer is a copy in ``<workdir>/hook`` with that text in
    ``<workdir>/hook/limits`` beside it, as the device plugin mounts them; ``limits`` stay in the
    environment, as a pod's own ``env`` would put them."""
    workdir.mkdir(parents=True)
    config = workdir / "gpus.conf"
    config.write_text(extra_config + gpus)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HAMIPY_FAKE_GPU_CONFIG": str(config),
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(workdir / "vgpu.cache"),
        "LD_LIBRARY_PATH": str(build / "fake"),
        "ASAN_OPTIONS": "detect_leaks=0",
        **(limits or {}),
    }
    interposer = build / "libvgpu.so"
    if limits_file is not None:
        hook = workdir / "hook"
        hook.mkdir()
        interposer = hook / "libvgpu.so"
        shutil.copyfile(build / "libvgpu.so", interposer)
        (hook / "limits").write_text(limits_file)
    preloads = preload_value(build, interposer=preload, library=interposer)
    if preloads:
        env["LD_PRELOAD"] = preloads
    return Container(build=build, workdir=workdir, env=env)


def preload_value(build: Path, *, interposer: bool, library: Path | None = None) -> str:
    """LD_PRELOAD for a container process (the ASan runtime first on the sanitizer build);
    ``library``: the interposer's path (default: the build's)."""
    libs = [str(library or build / "libvgpu.so")] if interposer else []
    if build.name == "build-asan":
        asan = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        )
        libs.insert(0, asan.stdout.strip())
    return " ".join(libs)


def run_python(container: Container, code: str) -> subprocess.CompletedProcess[str]:
    """Runs Python code (with pynvml importable) as a process of the container."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=container.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def expect_ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


STARTUP_TIMEOUT_S = 20


def wait_for_line(proc: subprocess.Popen[str], want: str) -> None:
    """Waits (bounded) until the process prints `want`, failing with its stderr otherwise."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], STARTUP_TIMEOUT_S)
    line = proc.stdout.readline().strip() if ready else ""
    if line != want:
        proc.kill()
        _, err = proc.communicate(timeout=STARTUP_TIMEOUT_S)
        pytest.fail(f"expected {want!r}, got {line!r}; stderr:\n{err}")


def stop(proc: subprocess.Popen[str]) -> None:
    """Closes the holder's stdin (it frees and exits) and reaps it."""
    proc.communicate(timeout=STARTUP_TIMEOUT_S)
