"""Child processes that die with us: spawn, log, health-wait, and stop a whole process group.

Each process runs in its own session (so one ``killpg`` reaches everything it forked) with
``PR_SET_PDEATHSIG=SIGKILL`` (so the kernel kills it if the Python process that started it dies,
even by SIGKILL, where no finalizer runs). The death signal is set by util-linux's ``setpriv``
before it execs the program, not by a ``preexec_fn``: Python code run between fork and exec in a
process with gRPC threads (the kubelet stand-in) can crash the child, and without a
``preexec_fn`` subprocess uses vfork, where no fork handlers run. Without ``setpriv`` (not a
Debian-like system) the ``preexec_fn`` is the fallback. Output goes to a per-process log file whose tail is
put in the error when the process dies or never becomes healthy.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hamipy.devcluster.errors import StartupError

_PR_SET_PDEATHSIG = 1
# Loaded before any fork: a preexec_fn must not import or allocate much.
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

LOG_TAIL_LINES = 40
# How long a process gets to exit after SIGTERM before its group is SIGKILLed. Data is throwaway,
# so a short grace keeps teardown fast while still letting etcd/apiserver close cleanly when they can.
STOP_GRACE_S = 3.0
# Timeout of one health probe (connect + response); the overall wait has its own deadline.
PROBE_TIMEOUT_S = 2.0
PROBE_INTERVAL_S = 0.1


def _die_with_parent() -> None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_SETPRIV = shutil.which("setpriv")


def _launch(argv: Sequence[str]) -> tuple[list[str], Callable[[], None] | None]:
    """The argv to spawn and the preexec_fn to use for a child that dies with us."""
    if _SETPRIV is not None:
        return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv], None
    return list(argv), _die_with_parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_listening(port: int, host: str = "127.0.0.1") -> bool:
    """True if something accepts TCP connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(PROBE_TIMEOUT_S)
        return sock.connect_ex((host, port)) == 0


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (and is not a zombie we could reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file, or a note if there is none."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


class ManagedProcess:
    """One control-plane process with its log file; `stop` ends its whole process group."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.env = None if env is None else dict(env)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started (pid {self._proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            argv, preexec = _launch(self.argv)
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,
                preexec_fn=preexec,
                close_fds=True,
            )

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self) -> str:
        return tail(self.log_path)

    def fail(self, reason: str) -> StartupError:
        """A StartupError for this process carrying its log tail."""
        return StartupError(self.name, reason, self.log_tail())

    def wait_healthy(self, probe: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        """Poll `probe` until true; raise with the log tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None:
                raise self.fail("was never started")
            code = self._proc.poll()
            if code is not None:
                raise self.fail(f"exited with code {code} before {what}")
            if probe():
                return
            if time.monotonic() >= deadline:
                raise self.fail(f"not {what} after {timeout_s:g}s")
            time.sleep(PROBE_INTERVAL_S)

    def kill(self) -> None:
        """SIGKILL the process group at once (a crash: nothing is cleaned up) and reap the process."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10.0)
        self._proc = None

    def pause(self) -> None:
        """SIGSTOP the process group: it holds its sockets open but answers nothing (a hung process)."""
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the process group after ``pause``."""
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`, and reap the process."""
        proc = self._proc
        if proc is None:
            return
        kill_group(proc.pid, grace_s=grace_s, waiter=proc.wait)
        self._proc = None


def kill_group(
    pgid: int, *, grace_s: float = STOP_GRACE_S, waiter: Callable[[float], object] | None = None
) -> None:
    """End process group `pgid` (its leader has pid == pgid): SIGTERM, wait, SIGKILL.

    `waiter(timeout)` reaps our own child; for a process that is not our child (``down`` stopping
    what ``up`` left) we poll its pid instead.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    if waiter is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            waiter(grace_s)
    else:
        while pid_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    # Kill whatever is left in the group, leader included, then make sure the leader is gone.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError as exc:  # pragma: no cover - only if the pid was reused by another user
        if exc.errno != errno.EPERM:
            raise
    if waiter is not None:
        waiter(10.0)
    else:
        end = time.monotonic() + 10.0
        while pid_alive(pgid) and time.monotonic() < end:
            time.sleep(0.05)


def https_ok(url: str, *, context: ssl.SSLContext, expect: bytes = b"ok") -> Callable[[], bool]:
    """A probe that is true when GET `url` answers 200 with a body starting with `expect`."""

    def probe() -> bool:
        try:
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
            )
            with opener.open(url, timeout=PROBE_TIMEOUT_S) as resp:
                return bool(resp.status == 200 and resp.read().strip().startswith(expect))
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return False

    return probe


def http_ok(url: str, *, expect: bytes) -> Callable[[], bool]:
    """A probe that is true when GET `url` (plain HTTP) answers 200 with `expect` in the body."""

    def probe() -> bool:
        try:
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(url, timeout=PROBE_TIMEOUT_S) as resp:
                return bool(resp.status == 200 and expect in resp.read())
        except (urllib.error.URLError, OSError):
            return False

    return probe
