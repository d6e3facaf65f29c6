"""Region files: good ones are decoded, bad ones are skipped with a reason, a log line and a count,
and nothing a container can put into its directory stops the reader."""

from __future__ import annotations

import io
import mmap
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
from monitor_fakes import (
    GPU_A,
    GPU_B,
    MIB,
    log_lines,
    make_fifo,
    process,
    region_dir,
    telemetry,
    write_region,
)

from hamipy.monitor.region_dirs import RegionDir, parse_region_dir
from hamipy.monitor.region_files import RegionFiles
from hamipy.monitor.telemetry import Telemetry
from hamipy.protocol.region import (
    MAGIC,
    OFFSET_DEVICE_NUM,
    OFFSET_MAJOR_VERSION,
    OFFSET_PROCS,
    OFFSET_RECENT_KERNEL,
    OFFSET_UTILIZATION_SWITCH,
    PROC_SEQLOCK,
    PROC_SLOT_SIZE,
    PROC_USED,
    REGION_FILE_SIZE,
    USED_CONTEXT_SIZE,
    USED_TOTAL,
    MemoryUsage,
    ProcessUsage,
    build_region,
    parse_region,
)


def reader(hook: Path) -> tuple[RegionFiles, Telemetry, io.StringIO]:
    t, stream = telemetry()
    return RegionFiles(hook, logger=t.logger, metrics=t.metrics, max_entries_per_dir=8), t, stream


def errors(t: Telemetry, reason: str) -> float:
    return (
        t.metrics.registry.get_sample_value("hamipy_monitor_region_errors_total", {"reason": reason}) or 0.0
    )


def test_a_good_region_is_decoded_with_its_pod_and_container(tmp_path: Path) -> None:
    write_region(
        tmp_path, "uid-1", "main", processes=[process(0, [700 * MIB], sm=[12]), process(3, [300 * MIB])]
    )
    files, _, _ = reader(tmp_path)
    (reading,) = files.read_all()
    assert (reading.dir.pod_uid, reading.dir.container, reading.problem) == ("uid-1", "main", None)
    assert reading.snapshot is not None
    (dev,) = reading.snapshot.devices
    assert (dev.uuid, dev.limit_bytes, dev.used_bytes, dev.sm_util) == (GPU_A, 3000 * MIB, 1000 * MIB, 12)
    files.close()


def test_a_container_without_a_region_file_yet_has_a_reading_without_file(tmp_path: Path) -> None:
    region_dir(tmp_path, "uid-1", "main")
    files, _, _ = reader(tmp_path)
    (reading,) = files.read_all()
    assert (reading.file, reading.snapshot, reading.problem) == (None, None, None)


def test_no_containers_directory_is_no_regions(tmp_path: Path) -> None:
    files, _, _ = reader(tmp_path / "absent")
    assert files.read_all() == []


def _foreign(buf: bytearray) -> bytearray:
    struct.pack_into("<i", buf, 0, 12345)
    return buf


def _version(buf: bytearray) -> bytearray:
    struct.pack_into("<I", buf, OFFSET_MAJOR_VERSION, 2)
    return buf


def _devices(buf: bytearray) -> bytearray:
    struct.pack_into("<Q", buf, OFFSET_DEVICE_NUM, 99)
    return buf


GOOD = build_region(uuids=[GPU_A], limits=[3000 * MIB], processes=[process(0, [100 * MIB])])
BAD_FILES = {
    "truncated": (bytes(GOOD[: len(GOOD) // 2]), "truncated"),
    "header-only": (bytes(GOOD[:10]), "truncated"),
    "empty": (b"", "uninitialised"),
    "zeros": (bytes(REGION_FILE_SIZE), "uninitialised"),
    "foreign": (bytes(_foreign(bytearray(GOOD))), "foreign"),
    "garbage": (os.urandom(REGION_FILE_SIZE), "foreign"),
    "version": (bytes(_version(bytearray(GOOD))), "version"),
    "devices": (bytes(_devices(bytearray(GOOD))), "malformed"),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_files_beside_good_ones_are_skipped_with_a_reason(tmp_path: Path, kind: str) -> None:
    content, reason = BAD_FILES[kind]
    write_region(tmp_path, "uid-good", "main", processes=[process(0, [100 * MIB])])
    bad = region_dir(tmp_path, "uid-bad", "main") / "x.cache"
    bad.write_bytes(content)
    files, t, stream = reader(tmp_path)
    for _ in range(3):  # counted and logged once, not per scan
        readings = {r.dir.pod_uid: r for r in files.read_all()}
        assert readings["uid-good"].snapshot is not None
        assert readings["uid-good"].snapshot.devices[0].used_bytes == 100 * MIB
        assert (readings["uid-bad"].snapshot, readings["uid-bad"].problem) == (None, reason)
    if reason == "uninitialised":
        assert errors(t, reason) == 0, "a file being created is not an error"
    else:
        assert errors(t, reason) == 1
        (line,) = [e for e in log_lines(stream) if e.get("file") == str(bad)]
        assert (line["level"], line["reason"]) == ("warning", reason)


def test_non_regular_cache_entries_are_unreadable_and_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.cache"
    outside.write_bytes(GOOD)
    (region_dir(tmp_path, "uid-link", "main") / "a.cache").symlink_to(outside)
    make_fifo(region_dir(tmp_path, "uid-fifo", "main") / "a.cache")  # opening it for reading would block
    (region_dir(tmp_path, "uid-dir", "main") / "a.cache").mkdir()
    files, t, _ = reader(tmp_path)
    readings = {r.dir.pod_uid: r.problem for r in files.read_all()}
    assert readings == {"uid-link": "unreadable", "uid-fifo": "unreadable", "uid-dir": "unreadable"}
    assert errors(t, "unreadable") == 3


def test_a_file_truncated_after_it_was_read_is_reported_not_fatal(tmp_path: Path) -> None:
    path = write_region(tmp_path, "uid-1", "main", processes=[process(0, [100 * MIB])])
    files, t, stream = reader(tmp_path)
    assert files.read_all()[0].snapshot is not None
    os.truncate(path, 4096)  # the container shrinks its own file under the open descriptor
    assert files.read_all()[0].problem == "truncated"
    path.write_bytes(GOOD)
    assert files.read_all()[0].snapshot is not None
    assert errors(t, "truncated") == 1
    assert any(e["event"] == "region file readable again" for e in log_lines(stream))


def test_a_replaced_file_is_opened_again(tmp_path: Path) -> None:
    path = write_region(tmp_path, "uid-1", "main", processes=[process(0, [100 * MIB])])
    files, _, _ = reader(tmp_path)
    assert files.read_all()[0].snapshot.devices[0].used_bytes == 100 * MIB  # type: ignore[union-attr]
    staged = path.with_suffix(".new")
    staged.write_bytes(build_region(uuids=[GPU_A], limits=[3000 * MIB], processes=[process(0, [200 * MIB])]))
    staged.replace(path)
    assert files.read_all()[0].snapshot.devices[0].used_bytes == 200 * MIB  # type: ignore[union-attr]


def test_of_several_region_files_the_newest_is_read(tmp_path: Path) -> None:
    old = write_region(tmp_path, "uid-1", "main", name="old.cache", processes=[process(0, [1 * MIB])])
    new = write_region(tmp_path, "uid-1", "main", name="new.cache", processes=[process(0, [2 * MIB])])
    os.utime(old, (1_000_000, 1_000_000))
    files, _, stream = reader(tmp_path)
    (reading,) = files.read_all()
    assert reading.file == new
    assert reading.snapshot.devices[0].used_bytes == 2 * MIB  # type: ignore[union-attr]
    assert [e["path"] for e in log_lines(stream) if e.get("reason") == "ignored"] == [str(old)]


def test_a_directory_flooded_with_files_costs_a_bounded_scan(tmp_path: Path) -> None:
    directory = region_dir(tmp_path, "uid-1", "main")
    for i in range(50):
        (directory / f"junk-{i}").write_bytes(b"")
    files, _, stream = reader(tmp_path)  # looks at 8 entries per directory
    files.read_all()
    assert any(e.get("reason") == "crowded" for e in log_lines(stream))


@pytest.mark.parametrize(
    "name", ["nounderscore", "_main", "uid-1_", "uid 1_main", ".hidden_x"], ids=lambda n: n or "empty"
)
def test_directories_not_named_podUID_container_are_ignored(tmp_path: Path, name: str) -> None:
    (tmp_path / "containers" / name).mkdir(parents=True)
    files, _, _ = reader(tmp_path)
    assert files.read_all() == []
    assert parse_region_dir(tmp_path, name) is None


def test_directory_names_split_at_the_first_underscore() -> None:
    d = parse_region_dir(Path("/usr/local/vgpu"), "0fc3eda5-e98b-a25b-5b0d-cf5c855d1448_app-1")
    assert d == RegionDir(
        "0fc3eda5-e98b-a25b-5b0d-cf5c855d1448",
        "app-1",
        Path("/usr/local/vgpu/containers/0fc3eda5-e98b-a25b-5b0d-cf5c855d1448_app-1"),
    )


def _slot_at(slot: int, field: int) -> int:
    return OFFSET_PROCS + slot * PROC_SLOT_SIZE + field


def test_a_slot_whose_writer_died_mid_update_is_reported_torn_and_still_counted(tmp_path: Path) -> None:
    path = write_region(
        tmp_path, "uid-1", "main", processes=[process(0, [100 * MIB]), process(1, [50 * MIB])]
    )
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        struct.pack_into("<Q", m, _slot_at(1, PROC_SEQLOCK), 7)  # odd for good
    files, _, _ = reader(tmp_path)
    snap = files.read_all()[0].snapshot
    assert snap is not None
    assert [(p.slot, p.torn) for p in snap.processes] == [(0, False), (1, True)]
    assert snap.devices[0].used_bytes == 150 * MIB


def test_reads_during_concurrent_slot_updates_are_consistent_or_torn(tmp_path: Path) -> None:
    """A writer updates a slot under its seqlock, keeping context == total / 3; no reading that is
    not marked torn may ever break that."""
    start = ProcessUsage(slot=0, pid=1, hostpid=1, used=(MemoryUsage(1 * MIB, 0, 0, 0, 3 * MIB),))
    path = write_region(tmp_path, "uid-1", "main", processes=[start])
    stop = threading.Event()
    ctx_at, total_at, seq_at = (
        _slot_at(0, PROC_USED + USED_CONTEXT_SIZE),
        _slot_at(0, PROC_USED + USED_TOTAL),
        _slot_at(0, PROC_SEQLOCK),
    )

    def writer() -> None:
        with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            seq, n = 0, MIB
            while not stop.is_set():
                n += 1
                struct.pack_into("<Q", m, seq_at, seq + 1)
                struct.pack_into("<Q", m, ctx_at, n)
                os.sched_yield()
                struct.pack_into("<Q", m, total_at, 3 * n)
                seq += 2
                struct.pack_into("<Q", m, seq_at, seq)

    thread = threading.Thread(target=writer, daemon=True)
    files, _, _ = reader(tmp_path)
    thread.start()
    try:
        for _ in range(400):
            snap = files.read_all()[0].snapshot
            assert snap is not None
            (proc,) = snap.processes
            if not proc.torn:
                assert proc.used[0].total_bytes == 3 * proc.used[0].context_bytes
    finally:
        stop.set()
        thread.join(timeout=10)
    assert parse_region(path.read_bytes()).processes[0].used[0].total_bytes % 3 == 0


def test_feedback_writes_land_at_the_protocol_offsets(tmp_path: Path) -> None:
    path = write_region(tmp_path, "uid-1", "main", recent_kernel=2, utilization_switch=1)
    files, t, _ = reader(tmp_path)
    files.read_all()
    assert files.write_feedback(path, "recent_kernel", -1)
    assert files.write_feedback(path, "utilization_switch", 0)
    data = path.read_bytes()
    assert struct.unpack_from("<i", data, OFFSET_RECENT_KERNEL)[0] == -1
    assert struct.unpack_from("<i", data, OFFSET_UTILIZATION_SWITCH)[0] == 0
    snap = parse_region(data)
    assert (snap.recent_kernel, snap.utilization_switch) == (-1, 0)
    assert (
        t.metrics.registry.get_sample_value(
            "hamipy_monitor_feedback_writes_total", {"field": "recent_kernel"}
        )
        == 1
    )


def test_feedback_is_not_written_into_a_file_that_stopped_being_a_region(tmp_path: Path) -> None:
    path = write_region(tmp_path, "uid-1", "main")
    files, _, stream = reader(tmp_path)
    files.read_all()
    os.truncate(path, 100)
    assert not files.write_feedback(path, "recent_kernel", 1)
    assert path.stat().st_size == 100, "a truncated file is not extended by the write"
    path.write_bytes(bytes(_foreign(bytearray(GOOD))))
    files.read_all()
    assert not files.write_feedback(path, "recent_kernel", 1)
    assert struct.unpack_from("<i", path.read_bytes(), 0)[0] != MAGIC
    assert sum(e["event"] == "region feedback not written" for e in log_lines(stream)) == 2


def test_a_read_only_region_is_read_but_gets_no_feedback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_region(tmp_path, "uid-1", "main")
    real_open = os.open

    def no_write(file: str, flags: int, *args: int) -> int:
        if flags & os.O_RDWR:  # as on a read-only mount, or for a file the monitor may not write
            raise PermissionError(13, "Permission denied", file)
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", no_write)
    files, _, stream = reader(tmp_path)
    assert files.read_all()[0].snapshot is not None
    assert not files.write_feedback(path, "recent_kernel", 1)
    assert any(e["event"].startswith("region file is read-only") for e in log_lines(stream))


def test_removing_a_directory_closes_its_files_and_deletes_it(tmp_path: Path) -> None:
    path = write_region(tmp_path, "uid-1", "main")
    write_region(tmp_path, "uid-2", "main", uuids=[GPU_B])
    files, t, _ = reader(tmp_path)
    (first, _) = sorted(files.read_all(), key=lambda r: r.dir.pod_uid)
    assert files.remove_dir(first.dir)
    assert not path.parent.exists()
    assert [r.dir.pod_uid for r in files.read_all()] == ["uid-2"]
    assert t.metrics.registry.get_sample_value("hamipy_monitor_region_dirs_removed_total") == 1


def test_a_copy_taken_across_an_update_is_never_reported_consistent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic version of the race above: the reader's second copy of the slots overlaps a
    writer's update (new context, old total, the new even seqlock); the reader must notice that the
    seqlock moved between its copies and read the slot again."""
    start = ProcessUsage(slot=0, pid=1, hostpid=1, used=(MemoryUsage(1 * MIB, 0, 0, 0, 3 * MIB),))
    path = write_region(tmp_path, "uid-1", "main", processes=[start])
    ctx_at, total_at, seq_at = (
        _slot_at(0, PROC_USED + USED_CONTEXT_SIZE),
        _slot_at(0, PROC_USED + USED_TOTAL),
        _slot_at(0, PROC_SEQLOCK),
    )
    files, _, _ = reader(tmp_path)
    real_preadv = os.preadv
    calls: list[int] = []

    def racing_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        if len(calls) == 3:  # the second copy of the slot area: a writer updates meanwhile
            with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
                struct.pack_into("<QQ", m, ctx_at, 2 * MIB, 0)
                struct.pack_into("<Q", m, total_at, 6 * MIB)
                struct.pack_into("<Q", m, seq_at, 2)
            got = real_preadv(fd, buffers, offset)
            struct.pack_into("<Q", buffers[0], total_at - offset, 3 * MIB)  # copied before the update
            return got
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", racing_preadv)
    snap = files.read_all()[0].snapshot
    assert snap is not None
    (proc,) = snap.processes
    assert not proc.torn
    assert (proc.used[0].context_bytes, proc.used[0].total_bytes) == (2 * MIB, 6 * MIB)
    assert len(calls) == 4, "the slot was read again on its own"


def test_states_of_directories_that_are_gone_are_forgotten(tmp_path: Path) -> None:
    bad = region_dir(tmp_path, "uid-bad", "main") / "x.cache"
    bad.write_bytes(b"short")
    (tmp_path / "containers" / "no-underscore").mkdir()
    files, t, stream = reader(tmp_path)
    files.read_all()
    files.read_all()
    assert errors(t, "truncated") == 1
    assert len(files._states) == 2
    shutil.rmtree(bad.parent)
    files.read_all()
    assert len(files._states) == 1, "the unrecognised directory is still there"
    region_dir(tmp_path, "uid-bad", "main").joinpath("x.cache").write_bytes(b"short")
    files.read_all()
    assert errors(t, "truncated") == 2, "a new bad file is a new error"
    assert sum(e.get("reason") == "unrecognised" for e in log_lines(stream)) == 1


def test_a_file_with_every_slot_stuck_mid_update_costs_a_bounded_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots = [process(i, [1 * MIB]) for i in range(1024)]
    path = write_region(tmp_path, "uid-1", "main", processes=slots)
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        for i in range(1024):
            struct.pack_into("<Q", m, _slot_at(i, PROC_SEQLOCK), 1)
    files, _, _ = reader(tmp_path)
    real_pread = os.pread
    calls = [0]

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        calls[0] += 1
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    snap = files.read_all()[0].snapshot
    assert snap is not None
    assert len(snap.processes) == 1024
    assert all(p.torn for p in snap.processes)
    assert snap.devices[0].used_bytes == 1024 * MIB
    assert calls[0] <= 256 + 1024, "64 re-reads per slot would be 65,536"
