"""The region files of this node's containers: finding, reading and writing them (the file I/O).

``<hook>/containers/<podUID>_<container>/*.cache`` holds one region file per GPU container, written
by the interposer in the container (docs/wire-format.md#region-file). ``RegionFiles.read_all`` scans the
directories and decodes each file with ``hamipy.protocol.region.parse_region``; ``write_feedback``
sets the two monitor-owned fields; ``remove_dir`` deletes the directory of a pod that is gone.

Why ``pread`` and not ``mmap``. The container owns its file (it is mounted read-write into it), so
it can truncate it at any moment; a process touching a mapped page past the new end of file is
killed by ``SIGBUS``, which Python cannot catch. One tenant could then take down the node's monitor
(HAMi's monitor maps the files and has that hole). Every read here is a ``pread`` into a private
buffer instead: a truncated file gives a short read, reported as ``truncated``.

A copy is not a consistent snapshot by itself: a slot may change while it is copied. Each slot
carries a seqlock (``hamipy.protocol.region`` documents the protocol), and the copy follows the
reader's side of it with two reads of the slot area::

    read A (header and slots);  read B (slots)
    slot i of B is consistent when seqlock_A[i] == seqlock_B[i] and it is even

because A's seqlock was read before B's fields and B's seqlock after them (a forward copy; x86_64
does not reorder loads, the same assumption the protocol's reader makes). A slot that fails that is
re-read alone (seqlock, then slot) up to ``SEQLOCK_MAX_ATTEMPTS`` times; one that never settles (a
writer killed inside its update) gets an odd seqlock in the private copy, so that ``parse_region``
reports it ``torn`` with the values of the last copy, as it would for a live mapping. Re-reads are
bounded per file (``_SETTLE_BUDGET``), so a file whose every slot is stuck costs a bounded scan.

Files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be regular files: the container could
put a symlink to a host file, or a FIFO, where its region should be. A directory holds one region;
where there are several ``.cache`` files (a second Allocate for the same container), the newest is
read and the others are logged once and ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import stat
import struct
import threading
from pathlib import Path
from typing import Final, cast

import structlog

from hamipy.monitor.errors import RegionError
from hamipy.monitor.region_dirs import (
    ERROR_PROBLEMS,
    RegionDir,
    RegionProblem,
    RegionReading,
    parse_region_dir,
    problem_of,
)
from hamipy.monitor.telemetry import Metrics
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.region import (
    MAX_PROCS,
    OFFSET_PROC_NUM,
    OFFSET_PROCS,
    OFFSET_RECENT_KERNEL,
    OFFSET_UTILIZATION_SWITCH,
    OFFSET_UUIDS,
    PROC_SEQLOCK,
    PROC_SLOT_SIZE,
    REGION_FILE_SIZE,
    REGION_STRUCT_SIZE,
    SEQLOCK_MAX_ATTEMPTS,
    RegionSnapshot,
    parse_region,
    write_recent_kernel,
    write_utilization_switch,
)

__all__ = ["CACHE_SUFFIX", "RegionFiles"]

CACHE_SUFFIX: Final = ".cache"
_CONTAINERS: Final = "containers"
_I32: Final = struct.Struct("<i")  # proc_num (hamipy.protocol.region layout)
_U64: Final = struct.Struct("<Q")  # a slot's seqlock
_OPEN_FLAGS: Final = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Slot re-reads for one file in one scan. A live interposer changes a few slots at a time, so this
# is never reached by one; a file whose every slot is stuck mid-update costs 256 reads, not 64 each.
_SETTLE_BUDGET: Final = 256
_WRITERS: Final = {
    "recent_kernel": (OFFSET_RECENT_KERNEL, write_recent_kernel),
    "utilization_switch": (OFFSET_UTILIZATION_SWITCH, write_utilization_switch),
}


@dataclasses.dataclass(slots=True)
class _OpenFile:
    fd: int
    device: int
    inode: int
    writable: bool


class RegionFiles:
    """The region files under one hook directory. Thread-safe: the scrape and the feedback pass
    run in worker threads and share the open files under one lock."""

    def __init__(
        self,
        hook_path: Path,
        *,
        logger: structlog.typing.FilteringBoundLogger,
        metrics: Metrics,
        max_entries_per_dir: int = 64,
    ) -> None:
        self.hook_path = hook_path
        self.containers_dir = hook_path / _CONTAINERS
        self.logger = logger
        self.metrics = metrics
        self.max_entries_per_dir = max_entries_per_dir
        self._lock = threading.Lock()
        self._buf = bytearray(REGION_FILE_SIZE)
        self._files: dict[Path, _OpenFile] = {}
        # Last state reported per file or directory, so each change is logged (and counted) once.
        self._states: dict[Path, str] = {}

    # --- reading ---

    def read_all(self) -> list[RegionReading]:
        """Every container directory under ``<hook>/containers`` and its region, read now."""
        with self._lock:
            present: set[Path] = {self.containers_dir}
            readings = [self._read_dir(d) for d in self._scan(present)]
            present.update(r.dir.path for r in readings)
            opened = {r.file for r in readings if r.file is not None}
            for path in [p for p in self._files if p not in opened]:
                self._close(path)
            # Forget the states of what is gone, so that the table does not grow with pod churn.
            for path in [p for p in self._states if p not in present and p.parent not in present]:
                del self._states[path]
            return readings

    def _scan(self, present: set[Path]) -> list[RegionDir]:
        try:
            entries = list(os.scandir(self.containers_dir))
        except FileNotFoundError:
            return []  # no GPU container has been served on this node yet
        except OSError as exc:
            self._note(self.containers_dir, "unreadable", f"cannot list region directories: {exc}")
            return []
        dirs = []
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            parsed = parse_region_dir(self.hook_path, entry.name)
            if parsed is None:
                present.add(Path(entry.path))
                self._note(Path(entry.path), "unrecognised", "directory name is not <podUID>_<container>")
                continue
            dirs.append(parsed)
        return dirs

    def _cache_files(self, directory: Path) -> list[tuple[float, Path]]:
        """``(mtime, path)`` of the region-file candidates in ``directory``, newest first."""
        found = []
        with os.scandir(directory) as it:
            for n, entry in enumerate(it):
                if n >= self.max_entries_per_dir:
                    self._note(
                        directory, "crowded", f"more than {self.max_entries_per_dir} entries; rest skipped"
                    )
                    break
                if entry.name.endswith(CACHE_SUFFIX):
                    found.append((entry.stat(follow_symlinks=False).st_mtime, Path(entry.path)))
        return sorted(found, reverse=True)

    def _read_dir(self, d: RegionDir) -> RegionReading:
        try:
            candidates = self._cache_files(d.path)
        except OSError as exc:
            self._note(d.path, "unreadable", f"cannot list the directory: {exc}")
            return RegionReading(d, problem="unreadable")
        if self._states.get(d.path) == "unreadable":
            self._note(d.path, "ok", "")
        if not candidates:
            return RegionReading(d)
        path = candidates[0][1]
        for _, extra in candidates[1:]:
            self._note(extra, "ignored", f"a newer region file is read instead: {path.name}")
        try:
            snapshot = self._read_file(path)
        except RegionError as exc:
            self._note(path, exc.reason, str(exc))
            return RegionReading(d, file=path, problem=cast(RegionProblem, exc.reason))
        self._note(path, "ok", "")
        return RegionReading(d, file=path, snapshot=snapshot)

    def _read_file(self, path: Path) -> RegionSnapshot:
        try:
            opened = self._open(path)
            return self._decode(opened.fd, path)
        except OSError as exc:
            self._close(path)
            raise RegionError(f"region file {path}: {exc.strerror or exc}", reason="unreadable") from exc

    def _decode(self, fd: int, path: Path) -> RegionSnapshot:
        size = os.fstat(fd).st_size
        if size == 0:
            raise RegionError(f"region file {path} is empty (being created)", reason="uninitialised")
        if size < REGION_STRUCT_SIZE:
            raise RegionError(
                f"region file {path}: {size} bytes, shorter than the {REGION_STRUCT_SIZE}-byte region",
                reason="truncated",
            )
        buf = self._buf
        self._fill(fd, path, OFFSET_PROC_NUM, REGION_STRUCT_SIZE)
        proc_num = _I32.unpack_from(buf, OFFSET_PROC_NUM)[0]
        slots = min(max(proc_num, 0), MAX_PROCS)  # parse_region refuses an out-of-range proc_num
        end = OFFSET_PROCS + slots * PROC_SLOT_SIZE
        self._fill(fd, path, 0, end)
        before = self._seqlocks(slots)
        self._fill(fd, path, OFFSET_PROCS, end)
        after = self._seqlocks(slots)
        budget = _SETTLE_BUDGET
        for i, (a, b) in enumerate(zip(before, after, strict=True)):
            if a != b or b & 1:
                budget -= self._settle(fd, path, i, max(1, min(budget, SEQLOCK_MAX_ATTEMPTS)))
        try:
            # Every slot of the private copy is settled (or marked torn): one look is enough.
            return parse_region(buf, max_attempts=1)
        except ProtocolError as exc:
            raise RegionError(f"region file {path}: {exc}", reason=problem_of(exc)) from exc

    def _seqlocks(self, slots: int) -> list[int]:
        # The seqlock of each slot, as little-endian u64 words (x86_64 order, as the region is).
        with (
            memoryview(self._buf) as view,
            view[OFFSET_PROCS : OFFSET_PROCS + slots * PROC_SLOT_SIZE] as area,
            area.cast("Q") as words,
        ):
            return words[PROC_SEQLOCK // 8 :: PROC_SLOT_SIZE // 8].tolist()

    def _settle(self, fd: int, path: Path, slot: int, attempts: int) -> int:
        """Re-read one slot under its seqlock, at most ``attempts`` times; mark it torn in the copy
        if it never settles. Returns the attempts used."""
        start = OFFSET_PROCS + slot * PROC_SLOT_SIZE
        seq_at = start + PROC_SEQLOCK
        for attempt in range(1, attempts + 1):
            raw = os.pread(fd, 8, seq_at)
            if len(raw) < 8:
                raise RegionError(f"region file {path} was truncated while being read", reason="truncated")
            first = _U64.unpack(raw)[0]
            if first & 1:
                continue
            self._fill(fd, path, start, start + PROC_SLOT_SIZE)
            if _U64.unpack_from(self._buf, seq_at)[0] == first:
                return attempt
        _U64.pack_into(self._buf, seq_at, _U64.unpack_from(self._buf, seq_at)[0] | 1)
        return attempts

    def _fill(self, fd: int, path: Path, start: int, stop: int) -> None:
        """``buf[start:stop]`` from the file at the same offsets; a short read means truncated."""
        with memoryview(self._buf) as view:
            while start < stop:
                with view[start:stop] as part:
                    got = os.preadv(fd, [part], start)
                if got == 0:
                    raise RegionError(
                        f"region file {path} ends at {start} bytes while being read", reason="truncated"
                    )
                start += got

    # --- writing ---

    def write_feedback(self, path: Path, field: str, value: int) -> bool:
        """Set ``recent_kernel`` or ``utilization_switch`` in the region file ``path`` through the
        protocol's writer; False (logged) when the file cannot take it now."""
        offset, writer = _WRITERS[field]
        with self._lock:
            opened = self._files.get(path)
            if opened is None or not opened.writable:
                return False
            try:
                if os.fstat(opened.fd).st_size < REGION_STRUCT_SIZE:
                    raise RegionError(f"region file {path} was truncated", reason="truncated")
                # A fresh header in the copy: the writer checks the magic and version on it.
                self._fill(opened.fd, path, 0, OFFSET_UUIDS)
                writer(self._buf, value)
                os.pwrite(opened.fd, self._buf[offset : offset + 4], offset)
            except (OSError, ProtocolError, RegionError) as exc:
                self.logger.warning(
                    "region feedback not written", file=str(path), field=field, error=str(exc)
                )
                return False
        self.metrics.feedback_writes.labels(field=field).inc()
        return True

    # --- housekeeping ---

    def remove_dir(self, d: RegionDir) -> bool:
        """Delete a container's region directory (its pod is gone); False (logged) on failure."""
        with self._lock:
            for path in [p for p in self._files if p.parent == d.path]:
                self._close(path)
            for path in [p for p in self._states if p == d.path or p.parent == d.path]:
                del self._states[path]
            errors: list[str] = []

            def failed(
                _func: object, path: str, exc_info: tuple[type[BaseException], BaseException, object]
            ) -> None:
                errors.append(f"{path}: {exc_info[1]}")

            shutil.rmtree(d.path, onerror=failed)  # symlink-safe: it never follows links out of d.path
        if errors and os.path.lexists(d.path):
            self.logger.warning(
                "region directory not removed", dir=str(d.path), pod_uid=d.pod_uid, errors=errors
            )
            return False
        self.metrics.dirs_removed.inc()
        self.logger.info("removed the region directory of a pod gone", dir=str(d.path), pod_uid=d.pod_uid)
        return True

    def close(self) -> None:
        with self._lock:
            for path in list(self._files):
                self._close(path)

    # --- internals ---

    def _open(self, path: Path) -> _OpenFile:
        st = os.stat(path, follow_symlinks=False)
        known = self._files.get(path)
        if known is not None and (known.device, known.inode) == (st.st_dev, st.st_ino):
            return known
        self._close(path)
        if not stat.S_ISREG(st.st_mode):
            raise RegionError(f"region file {path} is not a regular file", reason="unreadable")
        writable = True
        try:
            fd = os.open(path, os.O_RDWR | _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
            writable = False
            self.logger.warning("region file is read-only; no priority feedback for it", file=str(path))
        opened_st = os.fstat(fd)
        if not stat.S_ISREG(opened_st.st_mode):  # replaced between stat and open
            os.close(fd)
            raise RegionError(f"region file {path} is not a regular file", reason="unreadable")
        opened = _OpenFile(fd=fd, device=opened_st.st_dev, inode=opened_st.st_ino, writable=writable)
        self._files[path] = opened
        return opened

    def _close(self, path: Path) -> None:
        opened = self._files.pop(path, None)
        if opened is not None:
            with contextlib.suppress(OSError):
                os.close(opened.fd)

    def _note(self, path: Path, state: str, detail: str) -> None:
        """Log (and count, for errors) a file's or directory's state when it changes."""
        previous = self._states.get(path)
        if previous == state:
            return
        self._states[path] = state
        if state == "ok":
            if previous is not None:
                self.logger.info("region file readable again", file=str(path), was=previous)
            return
        if state in ERROR_PROBLEMS:
            self.metrics.region_errors.labels(reason=state).inc()
            self.logger.warning("region file skipped", file=str(path), reason=state, error=detail)
        else:
            self.logger.info("region entry skipped", path=str(path), reason=state, detail=detail)
