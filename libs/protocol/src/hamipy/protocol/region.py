"""The shared region, version 1.2: the one file the interposer and the monitor both speak.

Every CUDA process of a container ``mmap``s the same file (``CUDA_DEVICE_MEMORY_SHARED_CACHE``,
docs/wire-format.md#region-file) and records its memory and SM use in its own process slot; the monitor
reads the file to export per-container metrics and writes back two fields of priority feedback.
This module is the Python side of that contract: the offsets as named constants, a ``ctypes``
mirror to cross-check them, a decoder to typed snapshots, the two monitor-owned writers, and an
encoder for test fixtures. It works on buffers only (``bytes``, ``bytearray``, ``memoryview``,
``mmap.mmap``); opening and mapping the file is the caller's business.

Layout (little-endian, x86_64 glibc, ``sem_t`` is 32 bytes)::

          0  initialized_flag  i32   = 19920718 (MAGIC) once initialised
          4  major_version     u32   1
          8  minor_version     u32   2
         12  sm_init_flag      i32
         16  owner_pid         u64
         24  sem               sem_t (32)   lock for adding/removing slots
         56  device_num        u64   <= 16
         64  uuids[16][96]     NUL-terminated NVML UUIDs, by NVML index
       1600  limit[16]         u64   bytes, 0 = no limit
       1728  sm_limit[16]      u64   percent, 0 = no limit
       1856  procs[1024]       1960 bytes each (below)
    2008896  proc_num          i32   slots in use are 0..proc_num-1
    2008900  utilization_switch i32  written by the monitor
    2008904  recent_kernel     i32   written by the monitor
    2008908  priority          i32
    2008912  last_kernel_time  u64   epoch seconds
    2008920  sem_postinit      sem_t (32)
    2008952  end of struct; the file is one byte longer (2008953, as upstream writes it)

    process slot (1960 bytes)
          0  pid               i32   in the container's PID namespace
          4  hostpid           i32
          8  used[16]          64 bytes each: context_size, module_size, data_size, offset,
                               total, 3 unused (u64)
       1032  monitorused[16]   u64
       1160  device_util[16]   48 bytes each: dec_util, enc_util, sm_util, 3 unused (u64)
       1928  status            i32   0 exited, 1 running, 2 suspended
       1932  (4 bytes padding)
       1936  seqlock           u64
       1944  unused[2]         u64

Slot consistency (seqlock). A slot is many words written by a live process while the monitor reads
it, so each slot carries a sequence counter, initially 0 (a zero-filled file is consistent).

Writer (the C interposer; exactly this, for every change to any field of a slot)::

    s = load(slot->seqlock)                     // even; writers of one slot are serialised
                                                // (hold `sem`, or CAS s -> s+1 from an even s)
    store_relaxed(slot->seqlock, s + 1)         // odd: update in progress
    atomic_thread_fence(memory_order_release)
    ... write the slot's fields, each u64 with one aligned store ...
    store_release(slot->seqlock, s + 2)         // even again: update complete

Reader (this module, per live slot, at most ``max_attempts`` times)::

    s1 = load(seqlock);  if s1 is odd: retry
    copy = the slot's 1960 bytes, one slice copy
    s2 = load(seqlock);  if s2 != s1: retry
    decode copy

Only slots below ``proc_num`` are read, and of those only the ones whose status is non-zero or
whose seqlock is odd (a slot being filled); a copy that shows status 0 is skipped.
A slot that does not settle within ``max_attempts`` is not an error: it is returned with
``torn=True`` and the values of the last copy, and still counts in the container totals. The
reason is a writer killed inside its update, which leaves the seqlock odd for good; raising would
hide that container's metrics until the slot is reclaimed. A torn copy is still useful because every
field is an aligned u64 (or i32) store, single-copy atomic on x86_64: each value read is one the
field really held, only agreement between fields is lost. The reader relies on x86_64 load order
(loads are not reordered with loads) in place of acquire fences, which Python cannot issue.

Container totals per device (``DeviceUsage``) sum over slots ``< proc_num`` whose status is non-zero:
``used_bytes`` is the sum of ``used[i].total`` (docs/wire-format.md#region-file), likewise context,
module and data. ``sm_util`` is the sum of ``device_util[i].sm_util`` capped at 100: it is a
percentage of the whole GPU, and NVML's per-process samples can overlap so that the raw sum
exceeds 100.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import re
import struct
from collections.abc import Sequence

from hamipy.protocol.errors import ProtocolError

__all__ = [
    "MAGIC",
    "MAJOR_VERSION",
    "MAX_DEVICES",
    "MAX_PROCS",
    "MINOR_VERSION",
    "OFFSET_DEVICE_NUM",
    "OFFSET_INITIALIZED_FLAG",
    "OFFSET_LAST_KERNEL_TIME",
    "OFFSET_LIMIT",
    "OFFSET_MAJOR_VERSION",
    "OFFSET_MINOR_VERSION",
    "OFFSET_OWNER_PID",
    "OFFSET_PRIORITY",
    "OFFSET_PROCS",
    "OFFSET_PROC_NUM",
    "OFFSET_RECENT_KERNEL",
    "OFFSET_SEM",
    "OFFSET_SEM_POSTINIT",
    "OFFSET_SM_INIT_FLAG",
    "OFFSET_SM_LIMIT",
    "OFFSET_UTILIZATION_SWITCH",
    "OFFSET_UUIDS",
    "PROC_DEVICE_UTIL",
    "PROC_HOSTPID",
    "PROC_MONITORUSED",
    "PROC_PID",
    "PROC_SEQLOCK",
    "PROC_SLOT_SIZE",
    "PROC_STATUS",
    "PROC_UNUSED",
    "PROC_USED",
    "REGION_FILE_SIZE",
    "REGION_STRUCT_SIZE",
    "SEM_T_SIZE",
    "SEQLOCK_MAX_ATTEMPTS",
    "STATUS_EXITED",
    "STATUS_RUNNING",
    "STATUS_SUSPENDED",
    "USED_CONTEXT_SIZE",
    "USED_DATA_SIZE",
    "USED_ENTRY_SIZE",
    "USED_MODULE_SIZE",
    "USED_OFFSET",
    "USED_TOTAL",
    "UTIL_DEC_UTIL",
    "UTIL_ENC_UTIL",
    "UTIL_ENTRY_SIZE",
    "UTIL_SM_UTIL",
    "UUID_SIZE",
    "CDeviceMemory",
    "CDeviceUtil",
    "CProcSlot",
    "CSharedRegion",
    "DeviceUsage",
    "MemoryUsage",
    "ProcessUsage",
    "RegionBuffer",
    "RegionSnapshot",
    "build_region",
    "parse_region",
    "write_recent_kernel",
    "write_utilization_switch",
]

MAGIC = 19920718
MAJOR_VERSION = 1
MINOR_VERSION = 2

MAX_DEVICES = 16
MAX_PROCS = 1024
UUID_SIZE = 96
SEM_T_SIZE = 32  # glibc x86_64

STATUS_EXITED = 0
STATUS_RUNNING = 1
STATUS_SUSPENDED = 2

# Region header and tail.
OFFSET_INITIALIZED_FLAG = 0
OFFSET_MAJOR_VERSION = 4
OFFSET_MINOR_VERSION = 8
OFFSET_SM_INIT_FLAG = 12
OFFSET_OWNER_PID = 16
OFFSET_SEM = 24
OFFSET_DEVICE_NUM = 56
OFFSET_UUIDS = 64
OFFSET_LIMIT = 1600
OFFSET_SM_LIMIT = 1728
OFFSET_PROCS = 1856
OFFSET_PROC_NUM = 2008896
OFFSET_UTILIZATION_SWITCH = 2008900
OFFSET_RECENT_KERNEL = 2008904
OFFSET_PRIORITY = 2008908
OFFSET_LAST_KERNEL_TIME = 2008912
OFFSET_SEM_POSTINIT = 2008920
REGION_STRUCT_SIZE = 2008952
REGION_FILE_SIZE = 2008953  # upstream writes one byte past the struct

# Process slot, offsets inside the slot.
PROC_SLOT_SIZE = 1960
PROC_PID = 0
PROC_HOSTPID = 4
PROC_USED = 8
PROC_MONITORUSED = 1032
PROC_DEVICE_UTIL = 1160
PROC_STATUS = 1928
PROC_SEQLOCK = 1936
PROC_UNUSED = 1944

# One used[] entry (device_memory_t), offsets inside the entry.
USED_ENTRY_SIZE = 64
USED_CONTEXT_SIZE = 0
USED_MODULE_SIZE = 8
USED_DATA_SIZE = 16
USED_OFFSET = 24
USED_TOTAL = 32

# One device_util[] entry (device_util_t), offsets inside the entry.
UTIL_ENTRY_SIZE = 48
UTIL_DEC_UTIL = 0
UTIL_ENC_UTIL = 8
UTIL_SM_UTIL = 16

# Reads of one slot before it is reported torn. A writer's update is a handful of stores, so a
# live writer lets a reader through within a few attempts; the bound only matters for a writer
# that died inside its update.
SEQLOCK_MAX_ATTEMPTS = 64

RegionBuffer = bytes | bytearray | memoryview | mmap.mmap

_U64_MAX = (1 << 64) - 1
_I32_MIN = -(1 << 31)
_I32_MAX = (1 << 31) - 1
_SM_UTIL_CAP = 100


# --- ctypes mirror (for cross-checking the constants; the decoder uses struct) ---


class CDeviceMemory(ctypes.LittleEndianStructure):
    """``used[i]`` of a process slot (upstream ``device_memory_t``)."""

    _fields_ = (
        ("context_size", ctypes.c_uint64),
        ("module_size", ctypes.c_uint64),
        ("data_size", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("total", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 3),
    )


class CDeviceUtil(ctypes.LittleEndianStructure):
    """``device_util[i]`` of a process slot (upstream ``device_util_t``)."""

    _fields_ = (
        ("dec_util", ctypes.c_uint64),
        ("enc_util", ctypes.c_uint64),
        ("sm_util", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 3),
    )


class CProcSlot(ctypes.LittleEndianStructure):
    """One process slot (upstream ``shrreg_proc_slot_t``), padding spelled out."""

    _fields_ = (
        ("pid", ctypes.c_int32),
        ("hostpid", ctypes.c_int32),
        ("used", CDeviceMemory * MAX_DEVICES),
        ("monitorused", ctypes.c_uint64 * MAX_DEVICES),
        ("device_util", CDeviceUtil * MAX_DEVICES),
        ("status", ctypes.c_int32),
        ("_pad_status", ctypes.c_uint8 * 4),
        ("seqlock", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 2),
    )


class CSharedRegion(ctypes.LittleEndianStructure):
    """The whole region (upstream ``shared_region_t``); ``sem_t`` as 32 opaque, 8-aligned bytes."""

    _fields_ = (
        ("initialized_flag", ctypes.c_int32),
        ("major_version", ctypes.c_uint32),
        ("minor_version", ctypes.c_uint32),
        ("sm_init_flag", ctypes.c_int32),
        ("owner_pid", ctypes.c_uint64),
        ("sem", ctypes.c_uint64 * (SEM_T_SIZE // 8)),
        ("device_num", ctypes.c_uint64),
        ("uuids", (ctypes.c_char * UUID_SIZE) * MAX_DEVICES),
        ("limit", ctypes.c_uint64 * MAX_DEVICES),
        ("sm_limit", ctypes.c_uint64 * MAX_DEVICES),
        ("procs", CProcSlot * MAX_PROCS),
        ("proc_num", ctypes.c_int32),
        ("utilization_switch", ctypes.c_int32),
        ("recent_kernel", ctypes.c_int32),
        ("priority", ctypes.c_int32),
        ("last_kernel_time", ctypes.c_uint64),
        ("sem_postinit", ctypes.c_uint64 * (SEM_T_SIZE // 8)),
    )


# --- typed snapshots ---


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryUsage:
    """``used[i]`` of one process on one device, in bytes (``offset`` as the interposer keeps it)."""

    context_bytes: int = 0
    module_bytes: int = 0
    data_bytes: int = 0
    offset: int = 0
    total_bytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessUsage:
    """One live process slot.

    ``slot`` is its index in ``procs``; ``used``, ``monitorused_bytes`` and ``sm_util`` (percent)
    have one entry per device of the region. ``torn`` says the slot kept changing while it was read
    (see the module docstring); its values are then those of the last copy.
    """

    slot: int
    pid: int
    hostpid: int
    status: int = STATUS_RUNNING
    used: tuple[MemoryUsage, ...] = ()
    monitorused_bytes: tuple[int, ...] = ()
    sm_util: tuple[int, ...] = ()
    torn: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceUsage:
    """A container's totals on one device of its region (sums over live slots, see module docs)."""

    index: int
    uuid: str
    limit_bytes: int
    sm_limit: int
    used_bytes: int
    context_bytes: int
    module_bytes: int
    data_bytes: int
    sm_util: int


@dataclasses.dataclass(frozen=True, slots=True)
class RegionSnapshot:
    """One consistent-per-slot reading of a region.

    ``uuids``, ``limits`` (bytes) and ``sm_limits`` (percent) have ``device_num`` entries;
    ``processes`` are the slots below ``proc_num`` with non-zero status; ``devices`` the totals.
    """

    major: int
    minor: int
    owner_pid: int
    device_num: int
    uuids: tuple[str, ...]
    limits: tuple[int, ...]
    sm_limits: tuple[int, ...]
    proc_num: int
    utilization_switch: int
    recent_kernel: int
    priority: int
    last_kernel_time: int
    processes: tuple[ProcessUsage, ...]
    devices: tuple[DeviceUsage, ...]

    @property
    def torn(self) -> bool:
        """Whether any process slot was read torn."""
        return any(p.torn for p in self.processes)


# --- decoding ---

_HEADER = struct.Struct("<iIIiQ32xQ")  # initialized_flag .. device_num (0..64)
_LIMITS = struct.Struct(f"<{MAX_DEVICES}Q")
_TAIL = struct.Struct("<iiiiQ")  # proc_num .. last_kernel_time
_LOW_BIT = bytes(b & 1 for b in range(256))  # bytes.translate table: keep the parity bit
_NON_ZERO = re.compile(b"[^\\x00]")
_SEQ = struct.Struct("<Q")
_I32 = struct.Struct("<i")
# A whole slot in one call: pid, hostpid, 16 x used (5 values), 16 monitorused, 16 sm_util,
# status, seqlock.
_SLOT = struct.Struct("<ii" + "5Q24x" * MAX_DEVICES + f"{MAX_DEVICES}Q" + "16xQ24x" * MAX_DEVICES + "i4xQ16x")
_SLOT_MONITORUSED = 2 + 5 * MAX_DEVICES
_SLOT_SM_UTIL = _SLOT_MONITORUSED + MAX_DEVICES
_SLOT_STATUS = _SLOT_SM_UTIL + MAX_DEVICES
_SLOT_FIELDS = _SLOT_STATUS + 2


def _as_bytes_view(buf: RegionBuffer) -> RegionBuffer:
    if isinstance(buf, memoryview) and (buf.ndim != 1 or buf.itemsize != 1):
        return buf.cast("B")
    return buf


def _copy(buf: RegionBuffer, start: int, stop: int) -> bytes | bytearray:
    """One slice copy of ``buf[start:stop]`` (a memoryview slice is a view, so copy it)."""
    raw = buf[start:stop]
    if isinstance(raw, memoryview):
        return raw.tobytes()
    return raw


def _check_header(buf: RegionBuffer) -> tuple[int, int, int, int, int, int]:
    """Validate length, magic and version; return the header values."""
    size = buf.nbytes if isinstance(buf, memoryview) else len(buf)
    if size < REGION_STRUCT_SIZE:
        raise ProtocolError("region.size", size, f"shorter than the {REGION_STRUCT_SIZE}-byte region")
    flag, major, minor, sm_init, owner_pid, device_num = _HEADER.unpack_from(buf, 0)
    if flag != MAGIC:
        reason = "not initialised" if flag == 0 else f"wrong magic, expected {MAGIC}"
        raise ProtocolError("region.initialized_flag", flag, reason)
    if major != MAJOR_VERSION:
        raise ProtocolError("region.major_version", major, f"unsupported, expected {MAJOR_VERSION}")
    if minor != MINOR_VERSION:
        raise ProtocolError("region.minor_version", minor, f"unsupported, expected {MINOR_VERSION}")
    return flag, major, minor, sm_init, owner_pid, device_num


def _read_slot(buf: RegionBuffer, start: int, max_attempts: int) -> tuple[bytes | bytearray, bool]:
    """The seqlock reader of the module docstring: a consistent copy of one slot, or torn."""
    seq_at = start + PROC_SEQLOCK
    stop = start + PROC_SLOT_SIZE
    for _ in range(max_attempts):
        before = _copy(buf, seq_at, seq_at + 8)
        if before[0] & 1:  # little-endian: the low byte carries the parity
            continue
        raw = _copy(buf, start, stop)
        if _copy(buf, seq_at, seq_at + 8) == before:
            return raw, False
    return _copy(buf, start, stop), True


def _candidate_slots(buf: RegionBuffer, proc_num: int) -> list[int]:
    """Slots below ``proc_num`` with a non-zero status or an odd seqlock, found without a loop.

    One strided copy per status byte and one of each seqlock's low byte, ORed together as big
    integers: slot i is a candidate when byte i of the result is non-zero. This is only a filter;
    each candidate is then read under its seqlock, and one whose copy shows status 0 is skipped.
    """
    if proc_num == 0:
        return []
    end = OFFSET_PROCS + proc_num * PROC_SLOT_SIZE
    with memoryview(buf) as view:
        flags = int.from_bytes(
            view[OFFSET_PROCS + PROC_SEQLOCK : end : PROC_SLOT_SIZE].tobytes().translate(_LOW_BIT)
        )
        for byte in range(4):
            status_at = OFFSET_PROCS + PROC_STATUS + byte
            flags |= int.from_bytes(view[status_at:end:PROC_SLOT_SIZE].tobytes())
    return [m.start() for m in _NON_ZERO.finditer(flags.to_bytes(proc_num))]


def _decode_uuid(raw: bytes | bytearray, index: int) -> str:
    end = raw.find(b"\0")
    if end < 0:
        raise ProtocolError(f"region.uuids[{index}]", bytes(raw), "not NUL-terminated")
    try:
        return raw[:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"region.uuids[{index}]", bytes(raw[:end]), "not valid UTF-8") from exc


def parse_region(buf: RegionBuffer, *, max_attempts: int = SEQLOCK_MAX_ATTEMPTS) -> RegionSnapshot:
    """Decode a region image (a live ``mmap`` included) into a ``RegionSnapshot``.

    Raises ``ProtocolError`` naming the field for a short buffer (``region.size``), an
    uninitialised or foreign one (``region.initialized_flag``), another version, ``device_num``
    above 16, ``proc_num`` outside 0..1024, or a UUID that is not NUL-terminated UTF-8. Each live
    slot is read under its seqlock, at most ``max_attempts`` times (then ``torn``).
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    buf = _as_bytes_view(buf)
    _, major, minor, _, owner_pid, device_num = _check_header(buf)
    if device_num > MAX_DEVICES:
        raise ProtocolError("region.device_num", device_num, f"more than {MAX_DEVICES} devices")
    proc_num, utilization_switch, recent_kernel, priority, last_kernel_time = _TAIL.unpack_from(
        buf, OFFSET_PROC_NUM
    )
    if not 0 <= proc_num <= MAX_PROCS:
        raise ProtocolError("region.proc_num", proc_num, f"outside 0..{MAX_PROCS}")

    uuid_block = _copy(buf, OFFSET_UUIDS, OFFSET_UUIDS + UUID_SIZE * device_num)
    uuids = tuple(_decode_uuid(uuid_block[i * UUID_SIZE : (i + 1) * UUID_SIZE], i) for i in range(device_num))
    limits = _LIMITS.unpack_from(buf, OFFSET_LIMIT)[:device_num]
    sm_limits = _LIMITS.unpack_from(buf, OFFSET_SM_LIMIT)[:device_num]

    processes: list[ProcessUsage] = []
    live: list[tuple[int, ...]] = []
    used_at = range(2, 2 + 5 * device_num, 5)  # where each device's used[] values start
    for slot in _candidate_slots(buf, proc_num):
        start = OFFSET_PROCS + slot * PROC_SLOT_SIZE
        raw, torn = _read_slot(buf, start, max_attempts)
        values = _SLOT.unpack(raw)
        status = values[_SLOT_STATUS]
        if status == STATUS_EXITED:
            continue
        live.append(values)
        processes.append(
            ProcessUsage(
                slot,
                values[0],
                values[1],
                status,
                tuple([MemoryUsage(*values[i : i + 5]) for i in used_at]),
                values[_SLOT_MONITORUSED : _SLOT_MONITORUSED + device_num],
                values[_SLOT_SM_UTIL : _SLOT_SM_UTIL + device_num],
                torn,
            )
        )

    # Column sums over the live slots: columns[k] is value k of every live slot.
    columns = list(zip(*live, strict=True)) if live else [()] * _SLOT_FIELDS
    devices = tuple(
        DeviceUsage(
            d,
            uuids[d],
            limits[d],
            sm_limits[d],
            used_bytes=sum(columns[i + 4]),
            context_bytes=sum(columns[i]),
            module_bytes=sum(columns[i + 1]),
            data_bytes=sum(columns[i + 2]),
            sm_util=min(sum(columns[_SLOT_SM_UTIL + d]), _SM_UTIL_CAP),
        )
        for d, i in enumerate(used_at)
    )
    return RegionSnapshot(
        major=major,
        minor=minor,
        owner_pid=owner_pid,
        device_num=device_num,
        uuids=uuids,
        limits=limits,
        sm_limits=sm_limits,
        proc_num=proc_num,
        utilization_switch=utilization_switch,
        recent_kernel=recent_kernel,
        priority=priority,
        last_kernel_time=last_kernel_time,
        processes=tuple(processes),
        devices=devices,
    )


# --- the monitor's writers ---


def _write_i32(buf: RegionBuffer, offset: int, field: str, value: int) -> None:
    """Check the region and the value, then store it; ``TypeError`` for a read-only buffer."""
    buf = _as_bytes_view(buf)
    _check_header(buf)
    if not _I32_MIN <= value <= _I32_MAX:
        raise ProtocolError(field, value, "does not fit in i32")
    _I32.pack_into(buf, offset, value)


def write_recent_kernel(buf: RegionBuffer, value: int) -> None:
    """Set ``recent_kernel`` (4 bytes at ``OFFSET_RECENT_KERNEL``) of an initialised v1.2 region."""
    _write_i32(buf, OFFSET_RECENT_KERNEL, "region.recent_kernel", value)


def write_utilization_switch(buf: RegionBuffer, value: int) -> None:
    """Set ``utilization_switch`` (4 bytes at ``OFFSET_UTILIZATION_SWITCH``) of a v1.2 region."""
    _write_i32(buf, OFFSET_UTILIZATION_SWITCH, "region.utilization_switch", value)


# --- the fixture writer ---


def _check_range(field: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ProtocolError(field, value, f"outside {low}..{high}")
    return value


def _pad(field: str, values: Sequence[int], length: int, high: int) -> list[int]:
    if len(values) > length:
        raise ProtocolError(field, list(values), f"more than {length} entries")
    return [_check_range(f"{field}[{i}]", v, 0, high) for i, v in enumerate(values)] + [0] * (
        length - len(values)
    )


_MEMORY_FIELDS = tuple(f.name for f in dataclasses.fields(MemoryUsage))


def _encode_slot(process: ProcessUsage) -> bytes:
    field = f"region.procs[{process.slot}]"
    used = list(process.used)
    if len(used) > MAX_DEVICES:
        raise ProtocolError(f"{field}.used", len(used), f"more than {MAX_DEVICES} entries")
    used += [MemoryUsage()] * (MAX_DEVICES - len(used))
    used_values: list[int] = []
    for d, entry in enumerate(used):
        used_values += (
            _check_range(f"{field}.used[{d}].{name}", getattr(entry, name), 0, _U64_MAX)
            for name in _MEMORY_FIELDS
        )
    return _SLOT.pack(
        _check_range(f"{field}.pid", process.pid, _I32_MIN, _I32_MAX),
        _check_range(f"{field}.hostpid", process.hostpid, _I32_MIN, _I32_MAX),
        *used_values,
        *_pad(f"{field}.monitorused", process.monitorused_bytes, MAX_DEVICES, _U64_MAX),
        *_pad(f"{field}.sm_util", process.sm_util, MAX_DEVICES, _U64_MAX),
        _check_range(f"{field}.status", process.status, _I32_MIN, _I32_MAX),
        0,  # seqlock: even, no update in progress
    )


def build_region(
    *,
    uuids: Sequence[str],
    limits: Sequence[int] = (),
    sm_limits: Sequence[int] = (),
    processes: Sequence[ProcessUsage] = (),
    proc_num: int | None = None,
    owner_pid: int = 0,
    utilization_switch: int = 0,
    recent_kernel: int = 0,
    priority: int = 1,
    last_kernel_time: int = 0,
) -> bytearray:
    """A valid v1.2 region image of ``REGION_FILE_SIZE`` bytes, for tests and fixtures.

    The interposer is the real writer; this encoder exists so that tests (here and in other
    packages) can make region files from typed values. ``device_num`` is ``len(uuids)``;
    ``limits``/``sm_limits`` are zero-padded to 16; each process goes to its ``slot`` (its
    ``torn`` flag is ignored, every seqlock is written 0); ``proc_num`` defaults to one past the
    highest slot. Raises ``ProtocolError`` for a value that does not fit its field.
    """
    if len(uuids) > MAX_DEVICES:
        raise ProtocolError("region.uuids", list(uuids), f"more than {MAX_DEVICES} devices")
    slots = [_check_range("region.procs.slot", p.slot, 0, MAX_PROCS - 1) for p in processes]
    if len(set(slots)) != len(slots):
        raise ProtocolError("region.procs.slot", slots, "a slot is used twice")
    if proc_num is None:
        proc_num = max(slots, default=-1) + 1
    _check_range("region.proc_num", proc_num, 0, MAX_PROCS)

    buf = bytearray(REGION_FILE_SIZE)
    _HEADER.pack_into(
        buf,
        0,
        MAGIC,
        MAJOR_VERSION,
        MINOR_VERSION,
        0,
        _check_range("region.owner_pid", owner_pid, 0, _U64_MAX),
        len(uuids),
    )
    for i, uuid in enumerate(uuids):
        raw = uuid.encode("utf-8")
        if len(raw) >= UUID_SIZE or b"\0" in raw:
            raise ProtocolError(f"region.uuids[{i}]", uuid, f"needs at most {UUID_SIZE - 1} non-NUL bytes")
        start = OFFSET_UUIDS + i * UUID_SIZE
        buf[start : start + len(raw)] = raw
    _LIMITS.pack_into(buf, OFFSET_LIMIT, *_pad("region.limit", limits, MAX_DEVICES, _U64_MAX))
    _LIMITS.pack_into(buf, OFFSET_SM_LIMIT, *_pad("region.sm_limit", sm_limits, MAX_DEVICES, _U64_MAX))
    for process in processes:
        start = OFFSET_PROCS + process.slot * PROC_SLOT_SIZE
        buf[start : start + PROC_SLOT_SIZE] = _encode_slot(process)
    _TAIL.pack_into(
        buf,
        OFFSET_PROC_NUM,
        proc_num,
        _check_range("region.utilization_switch", utilization_switch, _I32_MIN, _I32_MAX),
        _check_range("region.recent_kernel", recent_kernel, _I32_MIN, _I32_MAX),
        _check_range("region.priority", priority, _I32_MIN, _I32_MAX),
        _check_range("region.last_kernel_time", last_kernel_time, 0, _U64_MAX),
    )
    return buf
