"""Mutation testing of the decision code: do the unit tests notice when a decision changes?

``make mutate`` (or ``python tests/mutation/mutate.py [--modules a,b]``) changes one module in one
small way at a time (the operators of ``operators.py``) and runs that module's unit tests
(``targets.toml``) against the change. A mutant the tests fail on is *killed*, one they pass on
*survived*: a decision no test pins. A mutant that makes the tests run past the timeout counts as
killed (``timeout``): a loop that no longer ends is noticed.

Why a driver of our own: mutmut 3 finds the code by file path relative to the directory it runs in
(``./``, ``src/``, ``source/``), copies the tests into the same tree and names mutants after the
path, so the workspace layout (namespace packages in ``libs/*/src`` and ``services/*/src``, tests at
the root) leaves it either without a test per mutant or with broken test ids (every mutant
"killed").

How a mutant runs: each worker holds an *overlay*, a copy of every package a selected module is in
(``hamipy/protocol``, ``hamipy/extender``, ...), put first on ``PYTHONPATH`` so that it shadows the
editable install. The worker writes the mutant over one file of its copy, runs
``pytest -x -q -p no:cacheprovider`` on the module's tests in a fresh directory (no ``.hypothesis``
database carries failures from one mutant to the next; ``--hypothesis-seed=0`` makes the examples
the same every run), and puts the file back. ``PYTHONDONTWRITEBYTECODE`` keeps a stale ``.pyc`` of
an earlier mutant from being loaded. Before its mutants, each module is run twice unmutated: once
as it is (the tests must pass; the time sets the timeout) and once with a line that raises at the
end of the module (the tests must fail: proof that the overlay, not the installed package, is
imported). After its last mutant it runs unmutated once more: the overlay holds only the measured
packages, so a change elsewhere in the tree during the run (a library, the tests) could otherwise
pass for killed mutants.

The results go to ``results/results.json`` beside this file (git-ignored), merged by module so a
run of a subset updates just those modules; a table goes to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operators import Mutant, mutants_of

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEFAULT_TARGETS = HERE / "targets.toml"
DEFAULT_RESULTS = HERE / "results" / "results.json"

CANARY = '\nraise RuntimeError("mutation overlay canary: this module must not be importable")\n'

Outcome = Literal["killed", "survived", "timeout"]

PYTEST_MISUSE = {4: "usage error", 5: "no tests collected"}
"""pytest exit codes that mean the driver ran it wrongly, not that a test failed."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """How mutants are run."""

    jobs: int = 2
    """Mutants run at once, each in its own pytest process; the machines here have 2 cores."""
    timeout_factor: float = 3.0
    """A mutant's run may take this many times the unmutated run, plus ``timeout_slack_s``: enough
    for a loaded machine, and a hanging mutant is still cut off in seconds."""
    timeout_slack_s: float = 10.0
    """Added to every timeout: pytest's start (about 1 s) varies most on a busy machine."""
    forkserver: bool = True
    """Fork every run from a process that has pytest and the libraries loaded (``forkserver.py``):
    about half the time of starting pytest anew for each mutant."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One module to mutate: its dotted name, its file, its package directory (what the overlay
    copies) and its tests (absolute paths)."""

    module: str
    path: Path
    package_dir: Path
    tests: tuple[Path, ...]

    @property
    def package(self) -> str:
        """``hamipy.protocol`` for ``hamipy.protocol.node_lock``: the top package under the
        ``hamipy`` namespace, which the overlay copies whole."""
        return ".".join(self.module.split(".")[:2])


@dataclasses.dataclass(frozen=True)
class Result:
    module: str
    mutant: Mutant
    outcome: Outcome
    seconds: float


class MutationError(Exception):
    """A module cannot be measured: its tests fail unmutated, or the overlay does not shadow it."""


# -- targets ------------------------------------------------------------------------------------------


def load_targets(config: Path, selection: Sequence[str]) -> list[Target]:
    """The modules of ``config``; with ``selection``, those named or under a named package
    (``hamipy.protocol`` selects every protocol module)."""
    with config.open("rb") as file:
        table = tomllib.load(file)["modules"]
    names = list(table)
    if selection:
        unknown = [s for s in selection if not any(n == s or n.startswith(s + ".") for n in names)]
        if unknown:
            raise SystemExit(f"not in {config.relative_to(ROOT)}: {', '.join(unknown)}")
        names = [n for n in names if any(n == s or n.startswith(s + ".") for s in selection)]
    targets = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise SystemExit(f"cannot find the source of {name}")
        path = Path(spec.origin)
        package_dir = path.parents[len(name.split(".")) - 3]
        tests = tuple(ROOT / t for t in table[name]["tests"])
        missing = [str(t) for t in tests if not t.exists()]
        if missing:
            raise SystemExit(f"{name}: no such test path: {', '.join(missing)}")
        targets.append(Target(module=name, path=path, package_dir=package_dir, tests=tests))
    return targets


# -- running ------------------------------------------------------------------------------------------


def pytest_args(tests: Sequence[Path]) -> list[str]:
    """The arguments of every run: stop at the first failure, no cache, the repository's config,
    the same hypothesis examples every time."""
    return [
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--rootdir={ROOT}",
        "-c",
        str(ROOT / "pyproject.toml"),
        "--hypothesis-seed=0",
        "--no-header",
        "--tb=no",
        *map(str, tests),
    ]


def _outcome(returncode: int, log: Path) -> Outcome:
    if returncode == 0:
        return "survived"
    if returncode in PYTEST_MISUSE:
        output = log.read_text(errors="replace") if log.exists() else ""
        raise MutationError(f"pytest: {PYTEST_MISUSE[returncode]}:\n{output}")
    return "killed"


class Worker:
    """An overlay (``<dir>/hamipy/<package>`` copies of every package a target is in) and, with
    ``forkserver``, a fork server that runs pytest with that overlay first on the path."""

    def __init__(self, overlay: Path, targets: Sequence[Target], *, forkserver: bool) -> None:
        self.overlay = overlay
        for package, source in {t.package: t.package_dir for t in targets}.items():
            destination = overlay.joinpath(*package.split("."))
            shutil.copytree(source, destination, ignore=shutil.ignore_patterns("__pycache__"))
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([str(overlay), *filter(None, [self.env.get("PYTHONPATH")])])
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.server: subprocess.Popen[str] | None = None
        if forkserver:
            self.server = subprocess.Popen(
                [sys.executable, str(HERE / "forkserver.py")],
                cwd=overlay,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            hello = self._answer()
            if not hello.get("ready"):
                raise MutationError(f"the fork server did not start: {hello}")

    def _answer(self) -> dict[str, object]:
        assert self.server is not None
        assert self.server.stdout is not None
        line = self.server.stdout.readline()
        if not line:
            raise MutationError(f"the fork server of {self.overlay} exited ({self.server.wait()})")
        answer: dict[str, object] = json.loads(line)
        return answer

    def mutate(self, target: Target, source: str, timeout_s: float) -> tuple[Outcome, float]:
        """Run ``target``'s tests with its file replaced by ``source``, then put the file back."""
        file = self.overlay.joinpath(*target.package.split("."), target.path.relative_to(target.package_dir))
        original = file.read_text()
        file.write_text(source)
        try:
            with tempfile.TemporaryDirectory(prefix="run-", dir=self.overlay.parent) as cwd:
                return self._run(target.tests, Path(cwd), timeout_s)
        finally:
            file.write_text(original)

    def _run(self, tests: Sequence[Path], cwd: Path, timeout_s: float) -> tuple[Outcome, float]:
        # A fresh working directory: no .hypothesis database carries one mutant's failures to the next.
        log = cwd / "pytest.log"
        if self.server is not None:
            assert self.server.stdin is not None
            request = {"args": pytest_args(tests), "cwd": str(cwd), "timeout_s": timeout_s}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            answer = self._answer()
            seconds = float(answer["seconds"])  # type: ignore[arg-type]
            if answer.get("outcome") == "timeout":
                return "timeout", seconds
            return _outcome(int(answer["returncode"]), log), seconds  # type: ignore[call-overload]
        started = time.monotonic()
        with log.open("w") as output:
            process = subprocess.Popen(
                [sys.executable, "-m", "pytest", *pytest_args(tests)],
                cwd=cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return "timeout", time.monotonic() - started
        return _outcome(process.returncode, log), time.monotonic() - started

    def close(self) -> None:
        if self.server is not None and self.server.stdin is not None:
            self.server.stdin.close()
            self.server.wait()


class Workers:
    """The workers, handed out one at a time to the threads that run mutants."""

    def __init__(self, base: Path, targets: Sequence[Target], count: int, *, forkserver: bool) -> None:
        self._all = [Worker(base / f"overlay-{i}", targets, forkserver=forkserver) for i in range(count)]
        self._free: queue.Queue[Worker] = queue.Queue()
        for worker in self._all:
            self._free.put(worker)

    def run(self, target: Target, source: str, timeout_s: float) -> tuple[Outcome, float]:
        worker = self._free.get()
        try:
            return worker.mutate(target, source, timeout_s)
        finally:
            self._free.put(worker)

    def close(self) -> None:
        for worker in self._all:
            worker.close()


def check_target(workers: Workers, target: Target, source: str) -> float:
    """Run ``target``'s tests unmutated (they must pass) and with the canary (they must fail);
    return the unmutated run's seconds."""
    outcome, seconds = workers.run(target, source, timeout_s=600)
    if outcome != "survived":
        raise MutationError(f"{target.module}: the tests fail on the unmutated module ({outcome})")
    outcome, _ = workers.run(target, source + CANARY, timeout_s=600)
    if outcome == "survived":
        raise MutationError(
            f"{target.module}: the tests pass with a module that raises on import: the overlay does "
            "not shadow the installed package"
        )
    return seconds


# -- reporting ----------------------------------------------------------------------------------------


def summary(target: Target, source: str, results: Sequence[Result], seconds: float) -> dict[str, object]:
    outcomes: tuple[Outcome, ...] = ("killed", "survived", "timeout")
    counts = {outcome: sum(r.outcome == outcome for r in results) for outcome in outcomes}
    total = len(results)
    survivors = sorted((r.mutant for r in results if r.outcome == "survived"), key=lambda m: m.index)
    return {
        "path": str(target.path.relative_to(ROOT)),
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "tests": [str(t.relative_to(ROOT)) for t in target.tests],
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "mutants": total,
        "killed": counts["killed"],
        "survived": counts["survived"],
        "timeouts": counts["timeout"],
        "score": round(100 * (total - counts["survived"]) / total, 1) if total else None,
        "survivors": [
            {
                "id": f"{target.module}#{m.index}",
                "line": m.line,
                "operator": m.operator,
                "diff": m.diff(source),
            }
            for m in survivors
        ],
    }


def write_results(path: Path, modules: dict[str, dict[str, object]]) -> None:
    """Merge ``modules`` into the results file (a run of a subset keeps the other modules)."""
    existing: dict[str, object] = {}
    if path.exists():
        try:
            existing = json.loads(path.read_text()).get("modules", {})
        except (json.JSONDecodeError, AttributeError):
            existing = {}
    merged = {**existing, **modules}
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"tool": "tests/mutation/mutate.py", "modules": dict(sorted(merged.items()))}
    path.write_text(json.dumps(document, indent=2) + "\n")


def table(modules: dict[str, dict[str, object]], *, header: bool = True) -> str:
    names = ("module", "mutants", "killed", "timeout", "survived", "score", "time")
    rows = ["{:<36} {:>7} {:>6} {:>7} {:>8} {:>6} {:>6}".format(*names)] if header else []
    for name, m in modules.items():
        score = "-" if m["score"] is None else f"{m['score']:.1f}%"
        rows.append(
            f"{name:<36} {m['mutants']:>7} {m['killed']:>6} {m['timeouts']:>7} {m['survived']:>8} "
            f"{score:>6} {m['seconds']:>5.0f}s"
        )
    return "\n".join(rows)


# -- main ---------------------------------------------------------------------------------------------


def measure(
    targets: Sequence[Target],
    sources: dict[str, str],
    mutants: dict[str, list[Mutant]],
    *,
    settings: Settings,
    verbose: bool,
    report: Callable[[Target, list[Result], float], None],
) -> list[str]:
    """Check every target, then run every mutant; ``report`` gets each module's results (and its
    unmutated run's seconds) as soon as its last mutant is done. Returns why modules were skipped
    (their tests fail unmutated, or the overlay does not shadow them)."""
    failed: list[str] = []
    total = sum(len(m) for m in mutants.values())
    started = time.monotonic()
    done = 0
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="hamipy-mutate-") as base:
        workers = Workers(Path(base), targets, settings.jobs, forkserver=settings.forkserver)
        try:
            with ThreadPoolExecutor(max_workers=settings.jobs) as pool:

                def checked(target: Target) -> float | MutationError:
                    try:
                        return check_target(workers, target, sources[target.module])
                    except MutationError as exc:
                        return exc

                checks = dict(zip((t.module for t in targets), pool.map(checked, targets), strict=True))
                baselines = {m: c for m, c in checks.items() if isinstance(c, float)}
                for error in (c for c in checks.values() if isinstance(c, MutationError)):
                    print(f"skipped: {error}", file=sys.stderr, flush=True)
                    failed.append(str(error))
                targets = [t for t in targets if t.module in baselines]
                results: dict[str, list[Result]] = {t.module: [] for t in targets}
                for target in targets:
                    if not mutants[target.module]:
                        report(target, [], baselines[target.module])

                def run_one(target: Target, mutant: Mutant) -> None:
                    nonlocal done
                    timeout_s = baselines[target.module] * settings.timeout_factor + settings.timeout_slack_s
                    outcome, seconds = workers.run(target, mutant.source, timeout_s)
                    with lock:
                        done += 1
                        own = results[target.module]
                        own.append(Result(target.module, mutant, outcome, seconds))
                        if verbose:
                            where = f"{target.module}#{mutant.index} line {mutant.line}"
                            print(f"  {where} {mutant.operator}: {outcome}", flush=True)
                        elif done % 100 == 0:
                            print(f"  {done}/{total} mutants, {time.monotonic() - started:.0f} s", flush=True)
                        finished = len(own) == len(mutants[target.module])
                    if not finished:
                        return
                    # The rest of the tree is live: if someone changed it during the run (a library
                    # the module imports, its tests), its mutants may have failed for that reason.
                    unmutated, _ = workers.run(target, sources[target.module], timeout_s)
                    with lock:
                        if unmutated == "survived":
                            report(target, own, baselines[target.module])
                            return
                        error = (
                            f"{target.module}: the tests fail unmutated after its mutants (the tree changed?)"
                        )
                        print(f"skipped: {error}", file=sys.stderr, flush=True)
                        failed.append(error)

                jobs = [pool.submit(run_one, t, m) for t in targets for m in mutants[t.module]]
                for job in jobs:
                    job.result()
        finally:
            workers.close()
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--modules",
        default=os.environ.get("MODULES", ""),
        help="comma- or space-separated modules or packages from targets.toml (default: all)",
    )
    parser.add_argument("--jobs", type=int, default=Settings.jobs)
    parser.add_argument("--timeout-factor", type=float, default=Settings.timeout_factor)
    parser.add_argument(
        "--no-forkserver", action="store_true", help="start a whole pytest process for every run (slower)"
    )
    parser.add_argument("--targets", type=Path, default=DEFAULT_TARGETS)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--list", action="store_true", help="print the mutants and run nothing")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every mutant's outcome")
    args = parser.parse_args(argv)
    settings = Settings(
        jobs=max(1, args.jobs), timeout_factor=args.timeout_factor, forkserver=not args.no_forkserver
    )
    targets = load_targets(args.targets, args.modules.replace(",", " ").split())
    sources = {t.module: t.path.read_text() for t in targets}
    mutants = {t.module: list(mutants_of(sources[t.module], filename=str(t.path))) for t in targets}

    if args.list:
        for target in targets:
            for m in mutants[target.module]:
                print(f"{target.module}#{m.index} line {m.line} {m.operator}")
                print("  " + m.diff(sources[target.module]).replace("\n", "\n  "))
        return 0

    total = sum(len(m) for m in mutants.values())
    print(f"{total} mutants in {len(targets)} modules, {settings.jobs} at a time", flush=True)
    started = time.monotonic()
    by_module: dict[str, dict[str, object]] = {}

    def report(target: Target, results: list[Result], baseline_s: float) -> None:
        seconds = sum(r.seconds for r in results) + baseline_s
        by_module[target.module] = summary(target, sources[target.module], results, seconds)
        write_results(args.results, {target.module: by_module[target.module]})
        print(table({target.module: by_module[target.module]}, header=False), flush=True)

    try:
        failed = measure(targets, sources, mutants, settings=settings, verbose=args.verbose, report=report)
    except MutationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(by_module))
    where = args.results.relative_to(ROOT) if args.results.is_relative_to(ROOT) else args.results
    print(f"{total} mutants in {time.monotonic() - started:.0f} s; results in {where}")
    for error in failed:
        print(f"skipped: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
