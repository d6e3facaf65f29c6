"""The limits file beside the interposer (docs/wire-format.md#limits-file): while it exists every
setting comes from it alone, whatever the container's own environment or region file say; a file
that cannot be read whole refuses every allocation."""

from __future__ import annotations

import mmap

import pytest
from native_support import GPU0_UUID, GPU1_UUID, NATIVE, Container, ContainerFactory, MiB, expect_ok

from hamipy.protocol.allocation_env import LIMITS_FILE
from hamipy.protocol.region import build_region, parse_region

pytestmark = pytest.mark.native

GiB_TEXT = "1g"


def limits(container_region: str, *lines: str) -> str:
    """A limits file's text as the device plugin writes it: the region path and ``lines``."""
    return "".join(f"{line}\n" for line in (*lines, f"CUDA_DEVICE_MEMORY_SHARED_CACHE={container_region}"))


def file_container(
    make_container: ContainerFactory, *lines: str, env: dict[str, str] | None = None
) -> Container:
    probe = make_container(limits=env)
    region = str(probe.workdir / "served.cache")
    container = make_container(limits=env, limits_file=limits(region, *lines))
    container.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = region  # where the tests look for it
    return container


def alloc(container: Container, mib: int, *, env: dict[str, str] | None = None) -> int:
    proc = container.run("region_peer", "alloc", str(mib), extra_env=env)
    assert proc.returncode in (0, 2), proc.stdout + proc.stderr
    return proc.returncode


def test_the_containers_own_limit_env_does_not_raise_the_files_limit(
    make_container: ContainerFactory,
) -> None:
    container = file_container(
        make_container, "CUDA_DEVICE_MEMORY_LIMIT_0=64m", env={"CUDA_DEVICE_MEMORY_LIMIT_0": GiB_TEXT}
    )
    assert alloc(container, 100) == 2
    assert alloc(container, 32) == 0


def test_a_name_the_file_does_not_hold_is_unset_whatever_the_env_says(
    make_container: ContainerFactory,
) -> None:
    # In the environment the per-device value overrides the generic one; here only the file counts.
    container = file_container(
        make_container, "CUDA_DEVICE_MEMORY_LIMIT=64m", env={"CUDA_DEVICE_MEMORY_LIMIT_0": GiB_TEXT}
    )
    assert alloc(container, 100) == 2


def test_without_a_file_the_environment_still_governs(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"})
    assert alloc(container, 100) == 2
    assert alloc(container, 100, env={"CUDA_DEVICE_MEMORY_LIMIT_0": GiB_TEXT}) == 0


def test_rewriting_the_region_files_limits_does_not_raise_them(make_container: ContainerFactory) -> None:
    container = file_container(make_container, "CUDA_DEVICE_MEMORY_LIMIT_0=64m")
    # What a process of the container could write into its region (the file is 0666).
    container.region_path.write_bytes(build_region(uuids=[GPU0_UUID, GPU1_UUID], limits=[1 << 30, 1 << 30]))
    proc = container.run("region_peer", "alloc", "100")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "differ from this process's; its own apply" in proc.stderr


def empty_region() -> bytes:
    return bytes(build_region(uuids=[GPU0_UUID, GPU1_UUID]))


def test_the_region_path_comes_from_the_file(make_container: ContainerFactory) -> None:
    container = file_container(make_container, "CUDA_DEVICE_MEMORY_LIMIT_0=64m")
    elsewhere = container.workdir / "private.cache"
    elsewhere.write_bytes(empty_region())  # the test program reads the region its env names
    holder = container.popen("region_peer", "hold", "40")
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        # A second process pointing its env elsewhere still shares the container's region.
        assert alloc(container, 40, env={"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(elsewhere)}) == 2
        with container.region_path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert parse_region(bytes(m)).devices[0].used_bytes == 40 * MiB
    finally:
        holder.communicate(timeout=20)
    assert elsewhere.read_bytes() == empty_region()


def test_priority_comes_from_the_file(make_container: ContainerFactory) -> None:
    container = file_container(
        make_container,
        "CUDA_DEVICE_MEMORY_LIMIT_0=64m",
        "CUDA_TASK_PRIORITY=0",
        env={"CUDA_TASK_PRIORITY": "1"},
    )
    expect_ok(container.run("region_peer", "alloc", "8"))
    with container.region_path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert parse_region(bytes(m)).priority == 0


@pytest.mark.parametrize(
    "text",
    ["CUDA_DEVICE_MEMORY_LIMIT_0\n", "=64m\n", "X=" + "y" * 600 + "\n"],
    ids=["no-equals", "no-name", "value-too-long"],
)
def test_a_malformed_limits_file_refuses_every_allocation(
    make_container: ContainerFactory, text: str
) -> None:
    container = make_container(limits_file=text)
    container.region_path.write_bytes(empty_region())  # the test program reads the region its env names
    proc = container.run("region_peer", "alloc", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds a malformed line" in proc.stderr


def test_an_unreadable_limits_file_refuses_every_allocation(make_container: ContainerFactory) -> None:
    container = make_container(limits_file="")
    limits_path = container.workdir / "hook" / "limits"
    limits_path.unlink()
    limits_path.mkdir()  # there, but not a file that can be read
    container.region_path.write_bytes(empty_region())
    proc = container.run("region_peer", "alloc", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "limits file" in proc.stderr


def test_the_interposer_looks_for_the_file_the_device_plugin_writes() -> None:
    header = (NATIVE / "src" / "vgpu.h").read_text()
    assert f'#define HAMI_LIMITS_FILE "{LIMITS_FILE}"' in header
