"""A pytest fork server: one per worker, so that a mutant's run does not pay pytest's start again.

Started by ``mutate.py`` with the worker's overlay first on ``PYTHONPATH``. It imports pytest and
the third-party libraries the tests use (about a second of every run) and never ``hamipy``; then,
for every request on stdin (one JSON line: the pytest arguments, a working directory and a timeout),
it forks a child that changes to that directory and runs ``pytest.main``. The child imports
``hamipy`` itself, so it gets the overlay's files as they are at that moment (the parent changed one
file before sending the request). The answer on stdout is one JSON line: the exit code, or
``"timeout"`` when the child ran past its time and was killed with its process group.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import sys
import time
import traceback

# Loaded before forking; anything not installed is simply loaded by each child. Not pytest plugins
# (pytest_asyncio, pytest_timeout, hypothesis): pytest rewrites their asserts, warns when they were
# imported first, and the configuration turns warnings into errors.
PRELOAD = ("pytest", "pydantic", "msgspec", "yaml", "aiohttp")


def _run_child(args: list[str], cwd: str, log: str) -> None:
    """In the forked child: run pytest, exit with its code; never returns."""
    code = 3
    try:
        os.setsid()
        os.chdir(cwd)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        import pytest

        code = int(pytest.main(args))
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(request: dict[str, object]) -> dict[str, object]:
    args = [str(a) for a in request["args"]]  # type: ignore[attr-defined]
    cwd = str(request["cwd"])
    log = os.path.join(cwd, "pytest.log")
    timeout_s = float(request["timeout_s"])  # type: ignore[arg-type]
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _run_child(args, cwd, log)
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        if not ready:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"outcome": "timeout", "seconds": time.monotonic() - started}
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    return {"returncode": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - started}


def main() -> int:
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    leaked = sorted(m for m in sys.modules if m == "hamipy" or m.startswith("hamipy."))
    if leaked:
        print(json.dumps({"error": f"preloading imported {', '.join(leaked)}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_serve(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
