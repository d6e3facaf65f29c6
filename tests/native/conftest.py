"""Fixtures for the native tests: build native/ once (a failed build fails the tests), and make
simulated containers whose processes run under LD_PRELOAD=libvgpu.so over the fake driver."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
from native_support import BUILD, BUILD_NAME, NATIVE, TWO_GPUS, Container, ContainerFactory, new_container


@pytest.fixture(scope="session")
def native_build() -> Path:
    """native/ built with make (incremental); a failed build fails the tests, never skips them."""
    target = ["asan"] if BUILD_NAME == "build-asan" else []
    proc = subprocess.run(
        ["make", "-C", str(NATIVE), *target], capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"make -C native failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return BUILD


@pytest.fixture
def make_container(native_build: Path, tmp_path: Path) -> ContainerFactory:
    """A factory: make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"}, gpus=..., preload=True,
    limits_file="CUDA_DEVICE_MEMORY_LIMIT_0=64m\\n")."""
    counter = iter(range(1000))

    def factory(
        *,
        limits: Mapping[str, str] | None = None,
        gpus: str = TWO_GPUS,
        extra_config: str = "",
        preload: bool = True,
        limits_file: str | None = None,
    ) -> Container:
        workdir = tmp_path / f"container{next(counter)}"
        return new_container(
            native_build,
            workdir,
            limits=limits,
            gpus=gpus,
            extra_config=extra_config,
            preload=preload,
            limits_file=limits_file,
        )

    return factory
