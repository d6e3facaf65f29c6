"""The region file: one limit for all processes of a container, a lock that survives its holder's
death, dead processes' slots reclaimed, and a layout hamipy.protocol reads."""

from __future__ import annotations

import mmap
import subprocess
import time

import pytest
from native_support import (
    GPU0_UUID,
    GPU1_UUID,
    STARTUP_TIMEOUT_S,
    Container,
    ContainerFactory,
    MiB,
    expect_ok,
    stop,
    wait_for_line,
)

pytestmark = pytest.mark.native

LIMIT_64M = {"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"}


def test_two_processes_share_one_limit(make_container: ContainerFactory) -> None:
    container = make_container(limits=LIMIT_64M)
    holder = container.popen("region_peer", "hold", "40")
    try:
        wait_for_line(holder, "held")
        refused = container.run("region_peer", "alloc", "32")
        assert refused.returncode == 2, refused.stderr
        assert refused.stdout.strip() == f"rc=2 used={40 * MiB}"
        fits = container.run("region_peer", "alloc", "24")
        assert fits.returncode == 0, fits.stderr
    finally:
        stop(holder)
    assert holder.returncode == 0
    expect_ok(container.run("region_peer", "alloc", "64"))


def test_kill_9_of_the_lock_holder_leaves_others_working(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "1g"})
    holder = container.popen("region_peer", "hold_lock", "600")
    wait_for_line(holder, "locked")
    waiter = container.popen("region_peer", "alloc", "100")
    try:
        # While the holder lives, the lock is really held: the waiter cannot finish.
        with pytest.raises(subprocess.TimeoutExpired):
            waiter.wait(timeout=1.0)
        killed_at = time.monotonic()
        holder.kill()
        holder.communicate(timeout=STARTUP_TIMEOUT_S)
        _, err = waiter.communicate(timeout=1.0)
        assert waiter.returncode == 0, err
        assert time.monotonic() - killed_at < 1.0
    finally:
        for proc in (holder, waiter):
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=STARTUP_TIMEOUT_S)
    # The dead holder's 600 MiB are reclaimed: 900 MiB fit in the 1 GiB limit.
    reclaimed = container.run("region_peer", "alloc", "900")
    assert reclaimed.returncode == 0, reclaimed.stdout + reclaimed.stderr
    assert reclaimed.stdout.strip() == f"rc=0 used={900 * MiB}"


def read_region(container: Container) -> bytes:
    with container.region_path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return bytes(m)


def test_region_file_layout(make_container: ContainerFactory) -> None:
    container = make_container(limits={**LIMIT_64M, "CUDA_DEVICE_SM_LIMIT": "30"})
    expect_ok(container.run("region_peer", "alloc", "8"))
    raw = read_region(container)
    assert len(raw) == 2_008_953
    assert int.from_bytes(raw[0:4], "little") == 19920718
    assert (int.from_bytes(raw[4:8], "little"), int.from_bytes(raw[8:12], "little")) == (1, 2)
    assert int.from_bytes(raw[56:64], "little") == 2
    assert raw[64 : 64 + 96].rstrip(b"\0").decode() == GPU0_UUID
    assert raw[160 : 160 + 96].rstrip(b"\0").decode() == GPU1_UUID
    assert int.from_bytes(raw[1600:1608], "little") == 64 * MiB
    assert int.from_bytes(raw[1608:1616], "little") == 0
    assert int.from_bytes(raw[1728:1736], "little") == 30
    # The process exited: its slot is released, usage is back to zero.
    assert int.from_bytes(raw[1856 + 8 + 32 : 1856 + 8 + 40], "little") == 0


def test_region_read_by_hamipy_protocol(make_container: ContainerFactory) -> None:
    region = pytest.importorskip("hamipy.protocol.region")
    container = make_container(limits=LIMIT_64M)
    holder = container.popen("region_peer", "hold", "40")
    try:
        wait_for_line(holder, "held")
        snapshot = region.parse_region(read_region(container))
        assert snapshot.devices[0].used_bytes == 40 * MiB
        assert snapshot.devices[0].data_bytes == 40 * MiB
        assert snapshot.devices[0].limit_bytes == 64 * MiB
        assert snapshot.devices[0].uuid == GPU0_UUID
        assert snapshot.devices[1].used_bytes == 0
        assert [p.pid for p in snapshot.processes] == [holder.pid]
    finally:
        stop(holder)
    assert region.parse_region(read_region(container)).devices[0].used_bytes == 0
