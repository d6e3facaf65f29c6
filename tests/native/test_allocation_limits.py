"""Every allocation path is refused past the limit with CUDA_ERROR_OUT_OF_MEMORY, allocates nothing
when refused, and is accounted exactly; the cuGetProcAddress and dlsym paths are limited too."""

from __future__ import annotations

import pytest
from native_support import ContainerFactory, expect_ok

pytestmark = pytest.mark.native

LIMIT_64M = {"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"}
ALLOCATION_PATHS = [
    "cuMemAlloc_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync",
    "cuMemAllocFromPoolAsync_ptsz",
    "cuMemCreate",
    "cuArrayCreate_v2",
    "cuArray3DCreate_v2",
    "cuMipmappedArrayCreate",
]


@pytest.mark.parametrize("path", ALLOCATION_PATHS)
def test_alloc_past_limit_returns_oom(make_container: ContainerFactory, path: str) -> None:
    container = make_container(limits=LIMIT_64M)
    assert expect_ok(container.run("alloc_past_limit_returns_oom", path)).strip() == f"ok {path}"


def test_getprocaddress_and_dlsym_paths_are_limited(make_container: ContainerFactory) -> None:
    container = make_container(limits=LIMIT_64M)
    expect_ok(container.run("getprocaddress_path_is_limited"))


def test_generic_limit_applies_to_every_device(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT": "64m"})
    expect_ok(container.run("alloc_past_limit_returns_oom", "cuMemAlloc_v2"))


def test_driver_failure_rolls_back_the_reservation(make_container: ContainerFactory) -> None:
    # No limit: the 1 GiB fake GPU itself refuses 2 GiB, and nothing stays reserved in the region.
    container = make_container()
    proc = container.run("region_peer", "alloc", "2048")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip() == "rc=2 used=0"
