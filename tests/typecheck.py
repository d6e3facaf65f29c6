"""mypy over the tests, under the project's settings (``make typecheck``).

The tests are not packages: a test imports its folder's helpers by name (``import extender_fakes``),
as pytest's "prepend" import mode puts each test's folder on ``sys.path``. mypy is told the same:
every test folder goes on its search path, so a file's module name is its name within its folder.
Several folders have a ``conftest.py``, and one mypy run cannot hold two modules of one name, so
the files are split into as few runs as keep the names apart: one run for nearly everything and one
for each further ``conftest.py``. The runs share mypy's cache with ``make typecheck``'s run over
the packages, so a warm rerun rechecks only what changed.

Usage: ``python tests/typecheck.py [mypy options]``; exits non-zero when any run finds errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SKIPPED_DIRS = {"__pycache__", ".mypy_cache", "results"}


def is_package(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


def folders_on_path(tests: Path = TESTS) -> list[Path]:
    """Every folder of Python files that pytest puts on ``sys.path``: the nearest folder that is not
    a package, for each file (``unit/protocol`` is a package, so ``unit`` holds it)."""
    folders = set()
    for path in python_files(tests):
        folder = path.parent
        while is_package(folder):
            folder = folder.parent
        folders.add(folder)
    return sorted(folders)


def python_files(tests: Path = TESTS) -> list[Path]:
    return sorted(p for p in tests.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(tests).parts))


def module_name(path: Path) -> str:
    """The name pytest imports ``path`` by: dotted from its nearest non-package folder."""
    parts = [path.stem] if path.name != "__init__.py" else []
    folder = path.parent
    while is_package(folder):
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def runs(files: Iterable[Path]) -> list[list[Path]]:
    """``files`` in as few groups as keep every module name unique within its group."""
    groups: list[tuple[set[str], list[Path]]] = []
    for path in files:
        name = module_name(path)
        group = next((g for g in groups if name not in g[0]), None)
        if group is None:
            group = (set(), [])
            groups.append(group)
        group[0].add(name)
        group[1].append(path)
    return [paths for _, paths in groups]


def mypy(files: Sequence[Path], folders: Sequence[Path], options: Sequence[str]) -> list[str]:
    """mypy's report on ``files`` (its summary line left out), with ``folders`` on its path."""
    env = {**os.environ, "MYPYPATH": os.pathsep.join(str(f) for f in folders)}
    command = [sys.executable, "-m", "mypy", "--no-error-summary", *options]
    command += [str(p.relative_to(ROOT)) for p in files]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    sys.stderr.write(done.stderr)
    if done.returncode not in (0, 1):  # 1: errors found; anything else: mypy itself failed
        return [*done.stdout.splitlines(), f"mypy exited {done.returncode} on {len(files)} files"]
    return done.stdout.splitlines()


def main(options: Sequence[str]) -> int:
    started = time.monotonic()
    folders = folders_on_path()
    groups = runs(python_files())
    # A module imported by a later run's conftest.py is checked again there: report it once.
    report = list(dict.fromkeys(line for group in groups for line in mypy(group, folders, options)))
    if report:
        print("\n".join(report))
    errors = sum(": error: " in line for line in report)
    files = sum(len(g) for g in groups)
    took = time.monotonic() - started
    print(f"tests: {errors} errors in {files} files ({len(groups)} mypy runs, {took:.1f} s)")
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
