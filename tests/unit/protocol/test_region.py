"""The shared region v1.2 read and written byte for byte (hamipy.protocol.region)."""

from __future__ import annotations

import ctypes
import mmap
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, SupportsIndex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hamipy.protocol import region
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.region import (
    MAX_DEVICES,
    MAX_PROCS,
    OFFSET_DEVICE_NUM,
    OFFSET_INITIALIZED_FLAG,
    OFFSET_MAJOR_VERSION,
    OFFSET_MINOR_VERSION,
    OFFSET_PROC_NUM,
    OFFSET_PROCS,
    OFFSET_RECENT_KERNEL,
    OFFSET_UTILIZATION_SWITCH,
    OFFSET_UUIDS,
    PROC_SEQLOCK,
    PROC_SLOT_SIZE,
    PROC_STATUS,
    PROC_USED,
    REGION_FILE_SIZE,
    REGION_STRUCT_SIZE,
    USED_TOTAL,
    CDeviceMemory,
    CDeviceUtil,
    CProcSlot,
    CSharedRegion,
    DeviceUsage,
    MemoryUsage,
    ProcessUsage,
    RegionSnapshot,
    build_region,
    parse_region,
    write_recent_kernel,
    write_utilization_switch,
)

UUID_A = "GPU-8f2c6d4e-1b3a-4c5d-9e7f-0a1b2c3d4e5f"
UUID_B = "GPU-00000000-1111-2222-3333-444444444444"
GIB = 1 << 30
MIB = 1 << 20

# docs/wire-format.md#region-file, copied by hand: the contract, not the module, is the source here.
REGION_OFFSETS = [
    ("OFFSET_INITIALIZED_FLAG", "initialized_flag", 0),
    ("OFFSET_MAJOR_VERSION", "major_version", 4),
    ("OFFSET_MINOR_VERSION", "minor_version", 8),
    ("OFFSET_SM_INIT_FLAG", "sm_init_flag", 12),
    ("OFFSET_OWNER_PID", "owner_pid", 16),
    ("OFFSET_SEM", "sem", 24),
    ("OFFSET_DEVICE_NUM", "device_num", 56),
    ("OFFSET_UUIDS", "uuids", 64),
    ("OFFSET_LIMIT", "limit", 1600),
    ("OFFSET_SM_LIMIT", "sm_limit", 1728),
    ("OFFSET_PROCS", "procs", 1856),
    ("OFFSET_PROC_NUM", "proc_num", 2008896),
    ("OFFSET_UTILIZATION_SWITCH", "utilization_switch", 2008900),
    ("OFFSET_RECENT_KERNEL", "recent_kernel", 2008904),
    ("OFFSET_PRIORITY", "priority", 2008908),
    ("OFFSET_LAST_KERNEL_TIME", "last_kernel_time", 2008912),
    ("OFFSET_SEM_POSTINIT", "sem_postinit", 2008920),
]
SLOT_OFFSETS = [
    ("PROC_PID", "pid", 0),
    ("PROC_HOSTPID", "hostpid", 4),
    ("PROC_USED", "used", 8),
    ("PROC_MONITORUSED", "monitorused", 1032),
    ("PROC_DEVICE_UTIL", "device_util", 1160),
    ("PROC_STATUS", "status", 1928),
    ("PROC_SEQLOCK", "seqlock", 1936),
    ("PROC_UNUSED", "unused", 1944),
]
USED_OFFSETS = [
    ("USED_CONTEXT_SIZE", "context_size", 0),
    ("USED_MODULE_SIZE", "module_size", 8),
    ("USED_DATA_SIZE", "data_size", 16),
    ("USED_OFFSET", "offset", 24),
    ("USED_TOTAL", "total", 32),
]
UTIL_OFFSETS = [
    ("UTIL_DEC_UTIL", "dec_util", 0),
    ("UTIL_ENC_UTIL", "enc_util", 8),
    ("UTIL_SM_UTIL", "sm_util", 16),
]
SIZES = [
    ("REGION_STRUCT_SIZE", 2_008_952),
    ("REGION_FILE_SIZE", 2_008_953),
    ("PROC_SLOT_SIZE", 1960),
    ("USED_ENTRY_SIZE", 64),
    ("UTIL_ENTRY_SIZE", 48),
    ("UUID_SIZE", 96),
    ("SEM_T_SIZE", 32),
    ("MAX_DEVICES", 16),
    ("MAX_PROCS", 1024),
    ("MAGIC", 19920718),
    ("MAJOR_VERSION", 1),
    ("MINOR_VERSION", 2),
    ("STATUS_EXITED", 0),
    ("STATUS_RUNNING", 1),
    ("STATUS_SUSPENDED", 2),
    ("SEQLOCK_MAX_ATTEMPTS", 64),
]


def _usage(total: int, *, context: int = 0, module: int = 0, data: int = 0) -> MemoryUsage:
    return MemoryUsage(
        context_bytes=context, module_bytes=module, data_bytes=data, offset=0, total_bytes=total
    )


def _proc(
    slot: int, total_a: int, total_b: int = 0, *, status: int = 1, sm: tuple[int, int] = (0, 0)
) -> ProcessUsage:
    return ProcessUsage(
        slot=slot,
        pid=100 + slot,
        hostpid=9000 + slot,
        status=status,
        used=(_usage(total_a, data=total_a), _usage(total_b, data=total_b)),
        monitorused_bytes=(0, 0),
        sm_util=sm,
    )


def _slot_at(slot: int, field: int) -> int:
    return OFFSET_PROCS + slot * PROC_SLOT_SIZE + field


def _total_at(slot: int, device: int) -> int:
    return _slot_at(slot, PROC_USED + device * 64 + USED_TOTAL)


# --- layout ---


@pytest.mark.parametrize(("name", "value"), SIZES, ids=[s[0] for s in SIZES])
def test_sizes_match_the_wire_contract(name: str, value: int) -> None:
    assert getattr(region, name) == value


@pytest.mark.parametrize(
    ("constant", "field", "offset"),
    [*REGION_OFFSETS, *SLOT_OFFSETS, *USED_OFFSETS, *UTIL_OFFSETS],
    ids=lambda v: v if isinstance(v, str) and v.isupper() else "",
)
def test_offset_constants_match_the_wire_contract(constant: str, field: str, offset: int) -> None:
    assert getattr(region, constant) == offset


@pytest.mark.parametrize(
    ("struct_type", "table"),
    [
        (CSharedRegion, REGION_OFFSETS),
        (CProcSlot, SLOT_OFFSETS),
        (CDeviceMemory, USED_OFFSETS),
        (CDeviceUtil, UTIL_OFFSETS),
    ],
    ids=["region", "proc_slot", "device_memory", "device_util"],
)
def test_ctypes_mirror_offsets_equal_the_constants(
    struct_type: type[ctypes.LittleEndianStructure], table: list[tuple[str, str, int]]
) -> None:
    for constant, field, offset in table:
        assert getattr(struct_type, field).offset == offset == getattr(region, constant), field


def test_ctypes_mirror_sizes_equal_the_constants() -> None:
    assert ctypes.sizeof(CSharedRegion) == REGION_STRUCT_SIZE
    assert ctypes.sizeof(CProcSlot) == PROC_SLOT_SIZE
    assert ctypes.sizeof(CDeviceMemory) == region.USED_ENTRY_SIZE
    assert ctypes.sizeof(CDeviceUtil) == region.UTIL_ENTRY_SIZE
    assert OFFSET_PROCS + MAX_PROCS * PROC_SLOT_SIZE == OFFSET_PROC_NUM


def test_ctypes_mirror_reads_a_built_region() -> None:
    buf = build_region(uuids=[UUID_A], limits=[2 * GIB], processes=[_proc(3, 5 * MIB)], priority=0)
    mirror = CSharedRegion.from_buffer(buf)
    assert mirror.initialized_flag == region.MAGIC
    assert mirror.device_num == 1
    assert mirror.uuids[0].value == UUID_A.encode()
    assert mirror.limit[0] == 2 * GIB
    assert mirror.proc_num == 4
    assert mirror.procs[3].used[0].total == 5 * MIB
    assert mirror.procs[3].hostpid == 9003
    del mirror  # release the export before the bytearray goes


def test_all_names_the_public_api() -> None:
    imported = {"annotations", "ProtocolError", "Sequence"}
    public = {
        name
        for name, value in vars(region).items()
        if not name.startswith("_") and name not in imported and not isinstance(value, type(region))
    }
    assert set(region.__all__) == public
    assert all(hasattr(region, name) for name in region.__all__)


# --- round trip ---


def test_round_trip_keeps_every_value() -> None:
    procs = [
        ProcessUsage(
            slot=0,
            pid=7,
            hostpid=31337,
            status=1,
            used=(
                MemoryUsage(
                    context_bytes=300 * MIB,
                    module_bytes=20 * MIB,
                    data_bytes=GIB,
                    offset=4096,
                    total_bytes=GIB + 320 * MIB,
                ),
                MemoryUsage(),
            ),
            monitorused_bytes=(GIB + 400 * MIB, 0),
            sm_util=(42, 0),
        ),
        ProcessUsage(
            slot=2,
            pid=8,
            hostpid=31338,
            status=2,
            used=(_usage(0), _usage((1 << 64) - 1)),
            monitorused_bytes=(0, 5),
            sm_util=(0, 100),
        ),
    ]
    buf = build_region(
        uuids=[UUID_A, UUID_B],
        limits=[4 * GIB, 8 * GIB],
        sm_limits=[30, 100],
        processes=procs,
        owner_pid=4242,
        utilization_switch=1,
        recent_kernel=-3,
        priority=0,
        last_kernel_time=1_700_000_000,
    )
    assert len(buf) == REGION_FILE_SIZE
    snap = parse_region(buf)
    assert snap == RegionSnapshot(
        major=1,
        minor=2,
        owner_pid=4242,
        device_num=2,
        uuids=(UUID_A, UUID_B),
        limits=(4 * GIB, 8 * GIB),
        sm_limits=(30, 100),
        proc_num=3,
        utilization_switch=1,
        recent_kernel=-3,
        priority=0,
        last_kernel_time=1_700_000_000,
        processes=tuple(procs),
        devices=(
            DeviceUsage(
                index=0,
                uuid=UUID_A,
                limit_bytes=4 * GIB,
                sm_limit=30,
                used_bytes=GIB + 320 * MIB,
                context_bytes=300 * MIB,
                module_bytes=20 * MIB,
                data_bytes=GIB,
                sm_util=42,
            ),
            DeviceUsage(
                index=1,
                uuid=UUID_B,
                limit_bytes=8 * GIB,
                sm_limit=100,
                used_bytes=(1 << 64) - 1,
                context_bytes=0,
                module_bytes=0,
                data_bytes=0,
                sm_util=100,
            ),
        ),
    )
    assert not snap.torn


def test_empty_region_has_no_devices_and_no_processes() -> None:
    snap = parse_region(build_region(uuids=[]))
    assert (snap.device_num, snap.uuids, snap.processes, snap.devices, snap.proc_num) == (0, (), (), (), 0)


def test_exact_struct_size_without_the_trailing_byte_parses() -> None:
    buf = build_region(uuids=[UUID_A])
    assert parse_region(bytes(buf[:REGION_STRUCT_SIZE])).uuids == (UUID_A,)


@pytest.mark.parametrize(
    "kind", ["bytes", "bytearray", "memoryview", "memoryview_u64", "memoryview_2d", "mmap"]
)
def test_every_buffer_kind_parses_alike(kind: str, tmp_path: Path) -> None:
    image = build_region(uuids=[UUID_A, UUID_B], limits=[GIB, GIB], processes=[_proc(0, MIB, 2 * MIB)])
    expected = parse_region(image)
    if kind == "mmap":
        path = tmp_path / "region.cache"
        path.write_bytes(image)
        with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
            assert parse_region(mapped) == expected
        return
    buffers: dict[str, Callable[[], region.RegionBuffer]] = {
        "bytes": lambda: bytes(image),
        "bytearray": lambda: image,
        "memoryview": lambda: memoryview(image),
        "memoryview_u64": lambda: memoryview(bytes(image[:REGION_STRUCT_SIZE])).cast("Q"),
        "memoryview_2d": lambda: memoryview(bytes(image[:REGION_STRUCT_SIZE])).cast(
            "B", shape=[8, REGION_STRUCT_SIZE // 8]
        ),
    }
    assert parse_region(buffers[kind]()) == expected


# --- container totals ---


def test_usage_is_summed_only_over_live_slots() -> None:
    buf = build_region(
        uuids=[UUID_A, UUID_B],
        processes=[
            _proc(0, 1 * GIB, sm=(10, 0)),
            _proc(1, 7 * GIB, 7 * GIB, status=0, sm=(50, 50)),  # exited: ignored
            _proc(2, 2 * GIB, 3 * GIB, status=2, sm=(5, 20)),  # suspended still uses memory
        ],
    )
    snap = parse_region(buf)
    assert [p.slot for p in snap.processes] == [0, 2]
    assert [d.used_bytes for d in snap.devices] == [3 * GIB, 3 * GIB]
    assert [d.data_bytes for d in snap.devices] == [3 * GIB, 3 * GIB]
    assert [d.sm_util for d in snap.devices] == [15, 20]


def test_slots_at_or_past_proc_num_are_not_read() -> None:
    buf = build_region(uuids=[UUID_A], processes=[_proc(0, GIB), _proc(5, 9 * GIB)], proc_num=3)
    snap = parse_region(buf)
    assert snap.proc_num == 3
    assert [p.slot for p in snap.processes] == [0]
    assert snap.devices[0].used_bytes == GIB


def test_sums_across_many_processes_and_devices() -> None:
    procs = [_proc(slot, (slot + 1) * MIB, (slot + 1) * 2 * MIB, sm=(3, 4)) for slot in range(0, 40, 2)]
    snap = parse_region(build_region(uuids=[UUID_A, UUID_B], limits=[GIB, 2 * GIB], processes=procs))
    expected_a = sum((slot + 1) * MIB for slot in range(0, 40, 2))
    assert len(snap.processes) == 20
    assert snap.devices[0].used_bytes == expected_a
    assert snap.devices[1].used_bytes == 2 * expected_a
    assert (snap.devices[0].sm_util, snap.devices[1].sm_util) == (60, 80)
    assert (snap.devices[0].limit_bytes, snap.devices[1].limit_bytes) == (GIB, 2 * GIB)


def test_sm_util_total_is_capped_at_100() -> None:
    procs = [_proc(slot, MIB, sm=(70, 0)) for slot in range(3)]
    snap = parse_region(build_region(uuids=[UUID_A, UUID_B], processes=procs))
    assert snap.devices[0].sm_util == 100
    assert [p.sm_util[0] for p in snap.processes] == [70, 70, 70]  # per process: raw


# --- malformed regions ---


def _poke(fmt: str, offset: int, value: int) -> bytearray:
    buf = build_region(uuids=[UUID_A], processes=[_proc(0, MIB)])
    struct.pack_into(fmt, buf, offset, value)
    return buf


def _bad_uuid(raw: bytes, uuids: list[str] | None = None) -> bytearray:
    buf = build_region(uuids=uuids or [UUID_A])
    buf[OFFSET_UUIDS : OFFSET_UUIDS + 96] = raw.ljust(96, b"\0")[:96]
    return buf


BAD_REGIONS: list[tuple[str, Callable[[], region.RegionBuffer], str, str]] = [
    ("empty", lambda: b"", "region.size", "shorter"),
    (
        "truncated",
        lambda: bytes(build_region(uuids=[UUID_A])[: REGION_STRUCT_SIZE - 1]),
        "region.size",
        "2008951",
    ),
    ("zero_filled", lambda: bytes(REGION_FILE_SIZE), "region.initialized_flag", "not initialised"),
    ("wrong_magic", lambda: _poke("<i", OFFSET_INITIALIZED_FLAG, 19920717), "initialized_flag", "magic"),
    ("major_2", lambda: _poke("<I", OFFSET_MAJOR_VERSION, 2), "region.major_version", "unsupported"),
    ("minor_1", lambda: _poke("<I", OFFSET_MINOR_VERSION, 1), "region.minor_version", "unsupported"),
    ("device_num_17", lambda: _poke("<Q", OFFSET_DEVICE_NUM, 17), "region.device_num", "17"),
    ("proc_num_-1", lambda: _poke("<i", OFFSET_PROC_NUM, -1), "region.proc_num", "-1"),
    ("proc_num_1025", lambda: _poke("<i", OFFSET_PROC_NUM, 1025), "region.proc_num", "1025"),
    ("uuid_not_utf8", lambda: _bad_uuid(b"GPU-\xff\xfe"), "region.uuids[0]", "UTF-8"),
    ("uuid_no_nul", lambda: _bad_uuid(b"G" * 96), "region.uuids[0]", "NUL"),
    # The next entry's NUL must not end an unterminated first UUID.
    (
        "uuid_no_nul_before_another",
        lambda: _bad_uuid(b"G" * 96, uuids=[UUID_A, UUID_B]),
        "region.uuids[0]",
        "NUL",
    ),
]


@pytest.mark.parametrize(
    ("make", "field", "mentions"), [b[1:] for b in BAD_REGIONS], ids=[b[0] for b in BAD_REGIONS]
)
def test_malformed_region_raises_naming_the_field(
    make: Callable[[], region.RegionBuffer], field: str, mentions: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_region(make())
    assert field in info.value.field
    assert mentions in str(info.value)


def test_max_device_and_proc_counts_are_accepted() -> None:
    uuids = [f"GPU-{i:04d}" for i in range(MAX_DEVICES)]
    snap = parse_region(build_region(uuids=uuids, processes=[_proc(MAX_PROCS - 1, MIB)]))
    assert snap.device_num == 16
    assert snap.proc_num == 1024
    assert [p.slot for p in snap.processes] == [1023]


def test_max_attempts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        parse_region(build_region(uuids=[]), max_attempts=0)
    assert parse_region(build_region(uuids=[UUID_A], processes=[_proc(0, MIB)]), max_attempts=1).processes


def test_sixteen_devices_without_processes_total_zero() -> None:
    snap = parse_region(build_region(uuids=[f"GPU-{i:04d}" for i in range(MAX_DEVICES)]))
    assert [d.used_bytes for d in snap.devices] == [0] * MAX_DEVICES
    assert [d.sm_util for d in snap.devices] == [0] * MAX_DEVICES


def test_status_with_only_its_high_byte_set_is_live() -> None:
    snap = parse_region(build_region(uuids=[UUID_A], processes=[_proc(0, MIB, status=1 << 24)]))
    assert [(p.slot, p.status) for p in snap.processes] == [(0, 1 << 24)]


def test_exited_slot_with_odd_seqlock_is_skipped_and_later_slots_still_read() -> None:
    image = build_region(uuids=[UUID_A], processes=[_proc(0, GIB, status=0), _proc(1, MIB)])
    struct.pack_into("<Q", image, _slot_at(0, PROC_SEQLOCK), 1)
    snap = parse_region(image, max_attempts=2)
    assert [p.slot for p in snap.processes] == [1]
    assert snap.devices[0].used_bytes == MIB


def test_build_region_defaults() -> None:
    buf = build_region(uuids=[UUID_A, UUID_B], limits=[GIB])
    snap = parse_region(buf)
    assert (snap.owner_pid, snap.utilization_switch, snap.recent_kernel, snap.priority) == (0, 0, 0, 1)
    assert snap.last_kernel_time == 0
    assert struct.unpack_from("<i", buf, region.OFFSET_SM_INIT_FLAG) == (0,)
    # Lists are zero-padded to 16 entries, past device_num too.
    assert struct.unpack_from("<16Q", buf, region.OFFSET_LIMIT) == (GIB,) + (0,) * 15


def test_build_region_pads_a_process_to_every_device() -> None:
    process = ProcessUsage(slot=0, pid=1, hostpid=1, used=(_usage(MIB),))
    (built,) = parse_region(build_region(uuids=[UUID_A, UUID_B], processes=[process])).processes
    assert built.used == (_usage(MIB), MemoryUsage(0, 0, 0, 0, 0))


def test_build_region_takes_sixteen_of_everything() -> None:
    full = ProcessUsage(slot=0, pid=1, hostpid=1, used=(_usage(MIB),) * MAX_DEVICES)
    uuids = [f"GPU-{i:04d}" for i in range(MAX_DEVICES)]
    snap = parse_region(build_region(uuids=uuids, limits=[GIB] * MAX_DEVICES, processes=[full]))
    assert snap.limits == (GIB,) * MAX_DEVICES
    assert snap.processes[0].used == (_usage(MIB),) * MAX_DEVICES


# --- seqlock ---


class ScriptedBuffer(bytearray):
    """A region whose slices inside one slot run a scripted writer step first.

    ``script[n]`` runs just before the n-th slice (from 1) that starts inside ``slot``: a stand-in
    for a writer that the reader races with, at exactly chosen points.
    """

    def __init__(self, image: bytearray, slot: int, script: dict[int, Callable[[bytearray], None]]):
        super().__init__(image)
        self.start = _slot_at(slot, 0)
        self.script = script
        self.reads = 0

    def __getitem__(self, key: SupportsIndex | slice) -> int | bytearray:  # type: ignore[override]
        if isinstance(key, slice) and self.start <= (key.start or 0) < self.start + PROC_SLOT_SIZE:
            self.reads += 1
            step = self.script.get(self.reads)
            if step is not None:
                step(self)
        return super().__getitem__(key)


def _set_seq(slot: int, value: int) -> Callable[[bytearray], None]:
    return lambda b: struct.pack_into("<Q", b, _slot_at(slot, PROC_SEQLOCK), value)


def _set_total(slot: int, value: int) -> Callable[[bytearray], None]:
    return lambda b: struct.pack_into("<Q", b, _total_at(slot, 0), value)


def _set_data(slot: int, value: int) -> Callable[[bytearray], None]:
    return lambda b: struct.pack_into("<Q", b, _slot_at(slot, PROC_USED + 16), value)


def _steps(*fns: Callable[[bytearray], None]) -> Callable[[bytearray], None]:
    def run(b: bytearray) -> None:
        for fn in fns:
            fn(b)

    return run


def test_odd_seqlock_that_never_settles_marks_the_slot_torn() -> None:
    image = build_region(uuids=[UUID_A], processes=[_proc(0, GIB), _proc(1, MIB)])
    struct.pack_into("<Q", image, _slot_at(1, PROC_SEQLOCK), 7)
    buf = ScriptedBuffer(image, 1, {})
    snap = parse_region(buf, max_attempts=5)
    assert snap.torn
    assert [(p.slot, p.torn) for p in snap.processes] == [(0, False), (1, True)]
    # A torn slot keeps the values of its last copy and still counts.
    assert snap.processes[1].used[0].total_bytes == MIB
    assert snap.devices[0].used_bytes == GIB + MIB
    # Five seqlock reads that all saw an odd value, then one final copy.
    assert buf.reads == 6


def test_slot_being_filled_is_read_under_its_seqlock() -> None:
    # Status still 0 but the seqlock odd: a writer is filling the slot, so it is not skipped.
    image = build_region(uuids=[UUID_A], processes=[_proc(0, GIB, status=0)])
    struct.pack_into("<Q", image, _slot_at(0, PROC_SEQLOCK), 1)
    buf = ScriptedBuffer(
        image,
        0,
        {2: _steps(lambda b: struct.pack_into("<i", b, _slot_at(0, PROC_STATUS), 1), _set_seq(0, 2))},
    )
    snap = parse_region(buf)
    assert [(p.slot, p.status, p.torn) for p in snap.processes] == [(0, 1, False)]


def test_writer_finishing_between_reads_is_retried_until_consistent() -> None:
    # The writer starts after the reader's first seqlock read: the copy sees half an update
    # (total new, data old), then the writer finishes before the second seqlock read.
    image = build_region(uuids=[UUID_A], processes=[_proc(0, GIB)])
    buf = ScriptedBuffer(
        image,
        0,
        {
            2: _steps(_set_seq(0, 1), _set_total(0, 3 * GIB)),
            3: _steps(_set_data(0, 3 * GIB), _set_seq(0, 2)),
        },
    )
    snap = parse_region(buf)
    (proc,) = snap.processes
    assert not proc.torn
    assert (proc.used[0].total_bytes, proc.used[0].data_bytes) == (3 * GIB, 3 * GIB)
    assert buf.reads == 6  # before, copy, after (changed); before, copy, after


def test_odd_seqlock_is_waited_out() -> None:
    image = build_region(uuids=[UUID_A], processes=[_proc(0, GIB)])
    struct.pack_into("<Q", image, _slot_at(0, PROC_SEQLOCK), 41)
    buf = ScriptedBuffer(image, 0, {3: _steps(_set_total(0, 2 * GIB), _set_seq(0, 42))})
    (proc,) = parse_region(buf).processes
    assert (proc.torn, proc.used[0].total_bytes, proc.used[0].data_bytes) == (False, 2 * GIB, GIB)


def test_concurrent_writer_thread_never_yields_a_mixed_slot() -> None:
    # A real writer thread following the seqlock protocol; it keeps data == total, and a
    # non-torn snapshot must never show them differing.
    image = build_region(uuids=[UUID_A], processes=[_proc(0, 0)])
    stop = threading.Event()

    def writer() -> None:
        seq = 0
        value = 0
        while not stop.is_set():
            value += MIB
            struct.pack_into("<Q", image, _slot_at(0, PROC_SEQLOCK), seq + 1)
            struct.pack_into("<Q", image, _total_at(0, 0), value)
            struct.pack_into("<Q", image, _slot_at(0, PROC_USED + 16), value)
            struct.pack_into("<Q", image, _slot_at(0, PROC_SEQLOCK), seq + 2)
            seq += 2

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=writer, name="region-writer")
    thread.start()
    consistent = 0
    try:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            (proc,) = parse_region(memoryview(image)).processes
            if not proc.torn:
                assert proc.used[0].total_bytes == proc.used[0].data_bytes
                consistent += 1
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old_interval)
    assert consistent > 0


# --- monitor writers ---

WRITERS = [
    (write_recent_kernel, OFFSET_RECENT_KERNEL, "recent_kernel"),
    (write_utilization_switch, OFFSET_UTILIZATION_SWITCH, "utilization_switch"),
]
WRITER_IDS = ["recent_kernel", "utilization_switch"]


def _diff(a: bytes | bytearray, b: bytes | bytearray) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


@pytest.mark.parametrize(("write", "offset", "attr"), WRITERS, ids=WRITER_IDS)
@pytest.mark.parametrize("value", [-1, 2**31 - 1, -(2**31), 0x01020304])
def test_writer_changes_exactly_its_four_bytes(
    write: Callable[[region.RegionBuffer, int], None], offset: int, attr: str, value: int
) -> None:
    before = build_region(uuids=[UUID_A], processes=[_proc(0, GIB)], recent_kernel=5, utilization_switch=5)
    buf = bytearray(before)
    write(buf, value)
    assert set(_diff(before, buf)) <= set(range(offset, offset + 4))
    assert struct.unpack_from("<i", buf, offset)[0] == value
    assert getattr(parse_region(buf), attr) == value


@pytest.mark.parametrize(("write", "offset", "attr"), WRITERS, ids=WRITER_IDS)
def test_writer_works_through_a_live_mmap(
    write: Callable[[region.RegionBuffer, int], None], offset: int, attr: str, tmp_path: Path
) -> None:
    path = tmp_path / "region.cache"
    path.write_bytes(build_region(uuids=[UUID_A]))
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        write(mapped, 77)
        mapped.flush()
    assert struct.unpack_from("<i", path.read_bytes(), offset)[0] == 77


BAD_WRITE_TARGETS: list[tuple[str, Callable[[], bytearray], str]] = [
    ("zero_filled", lambda: bytearray(REGION_FILE_SIZE), "region.initialized_flag"),
    ("truncated", lambda: build_region(uuids=[UUID_A])[: REGION_STRUCT_SIZE - 8], "region.size"),
    ("major_2", lambda: _poke("<I", OFFSET_MAJOR_VERSION, 2), "region.major_version"),
    ("minor_3", lambda: _poke("<I", OFFSET_MINOR_VERSION, 3), "region.minor_version"),
]


@pytest.mark.parametrize(("write", "offset", "attr"), WRITERS, ids=WRITER_IDS)
@pytest.mark.parametrize(
    ("make", "field"), [b[1:] for b in BAD_WRITE_TARGETS], ids=[b[0] for b in BAD_WRITE_TARGETS]
)
def test_writer_refuses_a_bad_buffer_and_leaves_it_alone(
    write: Callable[[region.RegionBuffer, int], None],
    offset: int,
    attr: str,
    make: Callable[[], bytearray],
    field: str,
) -> None:
    buf = make()
    before = bytes(buf)
    with pytest.raises(ProtocolError) as info:
        write(buf, 1)
    assert info.value.field == field
    assert buf == before


@pytest.mark.parametrize(("write", "offset", "attr"), WRITERS, ids=WRITER_IDS)
@pytest.mark.parametrize("value", [2**31, -(2**31) - 1])
def test_writer_refuses_a_value_outside_i32(
    write: Callable[[region.RegionBuffer, int], None], offset: int, attr: str, value: int
) -> None:
    buf = build_region(uuids=[UUID_A])
    before = bytes(buf)
    with pytest.raises(ProtocolError) as info:
        write(buf, value)
    assert info.value.field == f"region.{attr}"
    assert buf == before


# --- the fixture writer's own checks ---

BAD_BUILDS: list[tuple[str, Callable[[], object], str]] = [
    ("17_uuids", lambda: build_region(uuids=[UUID_A] * 17), "region.uuids"),
    ("uuid_96_bytes", lambda: build_region(uuids=["G" * 96]), "region.uuids[0]"),
    ("uuid_with_nul", lambda: build_region(uuids=["GPU\0x"]), "region.uuids[0]"),
    ("limit_negative", lambda: build_region(uuids=[UUID_A], limits=[-1]), "region.limit[0]"),
    ("limit_17", lambda: build_region(uuids=[UUID_A], limits=[0] * 17), "region.limit"),
    ("slot_1024", lambda: build_region(uuids=[], processes=[_proc(1024, 0)]), "region.procs.slot"),
    ("slot_twice", lambda: build_region(uuids=[], processes=[_proc(1, 0), _proc(1, 0)]), "region.procs.slot"),
    ("proc_num_1025", lambda: build_region(uuids=[], proc_num=1025), "region.proc_num"),
    ("priority_i32", lambda: build_region(uuids=[], priority=2**31), "region.priority"),
    ("slot_negative", lambda: build_region(uuids=[], processes=[_proc(-1, 0)]), "region.procs.slot"),
    ("proc_num_negative", lambda: build_region(uuids=[], proc_num=-1), "region.proc_num"),
    ("owner_pid_negative", lambda: build_region(uuids=[], owner_pid=-1), "region.owner_pid"),
    (
        "last_kernel_time_negative",
        lambda: build_region(uuids=[], last_kernel_time=-1),
        "region.last_kernel_time",
    ),
    (
        "context_negative",
        lambda: build_region(
            uuids=[UUID_A], processes=[ProcessUsage(slot=0, pid=1, hostpid=1, used=(_usage(0, context=-1),))]
        ),
        "region.procs[0].used[0].context_bytes",
    ),
    (
        "used_17",
        lambda: build_region(
            uuids=[UUID_A], processes=[ProcessUsage(slot=0, pid=1, hostpid=1, used=(_usage(0),) * 17)]
        ),
        "region.procs[0].used",
    ),
    (
        "total_u64",
        lambda: build_region(
            uuids=[UUID_A], processes=[ProcessUsage(slot=0, pid=1, hostpid=1, used=(_usage(1 << 64),))]
        ),
        "region.procs[0].used[0].total_bytes",
    ),
    (
        "sm_util_u64",
        lambda: build_region(
            uuids=[UUID_A], processes=[ProcessUsage(slot=3, pid=1, hostpid=1, sm_util=(-1,))]
        ),
        "region.procs[3].sm_util[0]",
    ),
]


@pytest.mark.parametrize(("build", "field"), [b[1:] for b in BAD_BUILDS], ids=[b[0] for b in BAD_BUILDS])
def test_build_region_refuses_values_that_do_not_fit(build: Callable[[], object], field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        build()
    assert info.value.field == field


# --- property ---

_u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
_i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
_uuid = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\0"), max_size=23)


@st.composite
def _regions(draw: st.DrawFn) -> tuple[dict[str, Any], list[ProcessUsage]]:
    n = draw(st.integers(min_value=0, max_value=MAX_DEVICES))
    uuids = draw(st.lists(_uuid, min_size=n, max_size=n))
    slots = draw(st.lists(st.integers(min_value=0, max_value=MAX_PROCS - 1), max_size=6, unique=True))
    procs = [
        ProcessUsage(
            slot=slot,
            pid=draw(_i32),
            hostpid=draw(_i32),
            status=draw(st.sampled_from([0, 1, 2])),
            used=tuple(
                MemoryUsage(draw(_u64), draw(_u64), draw(_u64), draw(_u64), draw(_u64)) for _ in range(n)
            ),
            monitorused_bytes=tuple(draw(st.lists(_u64, min_size=n, max_size=n))),
            sm_util=tuple(draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))),
        )
        for slot in slots
    ]
    kwargs: dict[str, Any] = {
        "uuids": uuids,
        "limits": draw(st.lists(_u64, min_size=n, max_size=n)),
        "sm_limits": draw(st.lists(st.integers(0, 100), min_size=n, max_size=n)),
        "owner_pid": draw(_u64),
        "utilization_switch": draw(_i32),
        "recent_kernel": draw(_i32),
        "priority": draw(_i32),
        "last_kernel_time": draw(_u64),
    }
    return kwargs, procs


@settings(max_examples=60, deadline=None)
@given(_regions())
def test_build_then_parse_round_trips(case: tuple[dict[str, Any], list[ProcessUsage]]) -> None:
    kwargs, procs = case
    snap = parse_region(build_region(processes=procs, **kwargs))
    live = tuple(sorted((p for p in procs if p.status != 0), key=lambda p: p.slot))
    assert snap.processes == live
    assert snap.uuids == tuple(kwargs["uuids"])
    assert snap.limits == tuple(kwargs["limits"])
    assert snap.sm_limits == tuple(kwargs["sm_limits"])
    for key in ("owner_pid", "utilization_switch", "recent_kernel", "priority", "last_kernel_time"):
        assert getattr(snap, key) == kwargs[key]
    assert snap.proc_num == max((p.slot + 1 for p in procs), default=0)
    for d, device in enumerate(snap.devices):
        assert device.used_bytes == sum(p.used[d].total_bytes for p in live)
        assert device.context_bytes == sum(p.used[d].context_bytes for p in live)
        assert device.sm_util == min(100, sum(p.sm_util[d] for p in live))


@pytest.mark.parametrize(("write", "offset", "attr"), WRITERS, ids=WRITER_IDS)
def test_writer_refuses_a_read_only_buffer(
    write: Callable[[region.RegionBuffer, int], None], offset: int, attr: str
) -> None:
    with pytest.raises(TypeError):
        write(bytes(build_region(uuids=[UUID_A])), 1)
