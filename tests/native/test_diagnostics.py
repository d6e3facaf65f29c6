"""LIBCUDA_LOG_LEVEL logs carry the pid; a bad environment value is reported once and handled
fail-closed (documented in docs/isolation.md), never a crash."""

from __future__ import annotations

import pytest
from native_support import ContainerFactory

pytestmark = pytest.mark.native


def test_bad_limit_is_reported_once_and_refuses_allocations(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "12x"})
    proc = container.run("region_peer", "alloc", "1")
    assert proc.returncode == 2, proc.stderr
    reports = [line for line in proc.stderr.splitlines() if "CUDA_DEVICE_MEMORY_LIMIT_0=12x" in line]
    assert len(reports) == 1
    assert reports[0].startswith("[hami-vgpu pid=")


def test_debug_log_lines_carry_the_pid(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "64m", "LIBCUDA_LOG_LEVEL": "4"})
    proc = container.run("region_peer", "alloc", "8")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line]
    assert lines
    assert all(line.startswith("[hami-vgpu pid=") for line in lines)
    assert any("+8388608 bytes" in line for line in lines)


def test_silent_by_default(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"})
    proc = container.run("region_peer", "alloc", "8")
    assert proc.returncode == 0
    assert proc.stderr == ""
