"""A real Prometheus for the tests: find or fetch ``prometheus``/``promtool``, run a server that
scrapes static targets and evaluates rule files, query it, and lint with promtool.

Binaries, in this order: ``prometheus`` and ``promtool`` on ``PATH``; the cache
(``<cache_root>/prometheus/<version>/``); else Debian's ``prometheus`` package, fetched with
``apt-get download`` (after ``apt-get update`` when the package lists lack it) and unpacked there
with ``dpkg-deb -x``. Nothing is installed system-wide and no service is started. A file lock
(``<cache_root>/prometheus.lock``) keeps parallel test processes from fetching at once. When no
binary can be had, `ensure_prometheus` raises `PrometheusUnavailable` saying which step failed (the
pytest fixtures turn that into a skip with that reason).

`PrometheusServer` is a context manager: it writes a config with one scrape job per `ScrapeTarget`
job name, short scrape and evaluation intervals and the given rule files, starts ``prometheus`` on a
free loopback port with a temporary TSDB, waits for ``/-/ready`` and stops it with SIGTERM, then
SIGKILL. Its API calls (`query`, `targets`, `rules`, `alerts`) are blocking HTTP requests with a
timeout: from an async test whose event loop also serves a scraped target, call them through
``asyncio.to_thread`` so the loop keeps answering the scrapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import yaml

from hamipy.devcluster.binaries import cache_root
from hamipy.devcluster.errors import BinaryBuildError, DevClusterError, StartupError, WaitTimeout
from hamipy.devcluster.processes import ManagedProcess, free_port, http_ok, tail

__all__ = [
    "DEBIAN_PACKAGE",
    "PrometheusBinaries",
    "PrometheusError",
    "PrometheusFactory",
    "PrometheusServer",
    "PrometheusUnavailable",
    "QueryResult",
    "ScrapeTarget",
    "ensure_prometheus",
    "promtool_check_metrics",
    "promtool_check_rules",
    "promtool_test_rules",
]

DEBIAN_PACKAGE = "prometheus"
APT_TIMEOUT_S = 300.0
TOOL_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.2

T = TypeVar("T")


class PrometheusUnavailable(BinaryBuildError):
    """``prometheus``/``promtool`` are not on PATH nor cached and could not be fetched; the message
    names the step that failed."""


class PrometheusError(DevClusterError):
    """The Prometheus HTTP API answered an error (a PromQL error carries Prometheus's own text)."""

    def __init__(self, what: str, error_type: str, error: str) -> None:
        self.what = what
        self.error_type = error_type
        self.error = error
        super().__init__(f"{what}: {error_type}: {error}")


@dataclasses.dataclass(frozen=True)
class PrometheusBinaries:
    """The two binaries, and the version ``prometheus --version`` reports."""

    prometheus: Path
    promtool: Path
    version: str


# -- finding and fetching the binaries ------------------------------------------------------------


def _tool_version(binary: Path) -> str:
    """``2.42.0+ds`` from "prometheus, version 2.42.0+ds (branch: ...)", or "" if it does not run."""
    try:
        proc = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    found = re.search(r"version\s+(\S+)", proc.stdout + proc.stderr)
    return found.group(1) if proc.returncode == 0 and found else ""


def _usable(prometheus: Path, promtool: Path) -> PrometheusBinaries | None:
    for binary in (prometheus, promtool):
        if not binary.is_file() or not os.access(binary, os.X_OK):
            return None
    version = _tool_version(prometheus)
    if not version or not _tool_version(promtool):
        return None
    return PrometheusBinaries(prometheus=prometheus, promtool=promtool, version=version)


def _on_path() -> PrometheusBinaries | None:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is None or promtool is None:
        return None
    return _usable(Path(prometheus), Path(promtool))


def prometheus_cache() -> Path:
    """Where fetched Prometheus binaries live: ``<cache_root>/prometheus/<package version>/``."""
    return cache_root() / "prometheus"


def _cached() -> PrometheusBinaries | None:
    root = prometheus_cache()
    if not root.is_dir():
        return None
    for version_dir in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if version_dir.name.startswith("."):
            continue  # an unfinished fetch
        found = _usable(version_dir / "prometheus", version_dir / "promtool")
        if found is not None:
            return found
    return None


def _run(argv: Sequence[str], *, cwd: Path | None = None, what: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), cwd=cwd, capture_output=True, text=True, timeout=APT_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise PrometheusUnavailable(
            f"{what}: {argv[0]} is not installed ({exc}); put prometheus and promtool on PATH"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise PrometheusUnavailable(f"{what}: `{' '.join(argv)}` took over {APT_TIMEOUT_S:g}s") from exc


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    text = (proc.stdout + proc.stderr).strip()
    return text[-1500:] if text else f"(no output, exit code {proc.returncode})"


def _apt_download(workdir: Path) -> Path:
    """``apt-get download prometheus`` into `workdir` (``apt-get update`` first if the lists lack it)."""
    what = f"fetching Debian's {DEBIAN_PACKAGE} package"
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise PrometheusUnavailable(
            f"{what}: apt-get/dpkg-deb not found (not a Debian-like system); put prometheus and "
            "promtool on PATH"
        )
    download = ["apt-get", "download", DEBIAN_PACKAGE]
    proc = _run(download, cwd=workdir, what=what)
    if proc.returncode != 0:
        first = _output(proc)
        update = _run(["apt-get", "update"], what=f"{what} (apt-get update)")
        if update.returncode != 0:
            hint = "" if os.geteuid() == 0 else " (apt-get update needs root)"
            raise PrometheusUnavailable(
                f"{what}: `apt-get download {DEBIAN_PACKAGE}` failed:\n{first}\nand `apt-get update` "
                f"failed{hint}:\n{_output(update)}"
            )
        proc = _run(download, cwd=workdir, what=what)
        if proc.returncode != 0:
            raise PrometheusUnavailable(
                f"{what}: `apt-get download {DEBIAN_PACKAGE}` failed after `apt-get update`:\n{_output(proc)}"
            )
    debs = sorted(workdir.glob(f"{DEBIAN_PACKAGE}_*.deb"))
    if not debs:
        raise PrometheusUnavailable(f"{what}: apt-get download left no .deb in {workdir}:\n{_output(proc)}")
    return debs[-1]


def _unpack(deb: Path, workdir: Path) -> Path:
    """Extract the package and return a directory holding just prometheus and promtool."""
    what = f"unpacking {deb.name}"
    version = _run(["dpkg-deb", "-f", str(deb), "Version"], what=what)
    if version.returncode != 0 or not version.stdout.strip():
        raise PrometheusUnavailable(f"{what}: cannot read its version:\n{_output(version)}")
    tree = workdir / "tree"
    extract = _run(["dpkg-deb", "-x", str(deb), str(tree)], what=what)
    if extract.returncode != 0:
        raise PrometheusUnavailable(f"{what}: dpkg-deb -x failed:\n{_output(extract)}")
    out = workdir / "bin"
    out.mkdir()
    for name in ("prometheus", "promtool"):
        binary = tree / "usr" / "bin" / name
        if not binary.is_file():
            raise PrometheusUnavailable(f"{what}: the package has no usr/bin/{name}")
        os.replace(binary, out / name)
    (out / "VERSION").write_text(version.stdout.strip() + "\n")
    return out


def _fetch() -> PrometheusBinaries:
    root = prometheus_cache()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=root))
    try:
        deb = _apt_download(work)
        staged = _unpack(deb, work)
        version = (staged / "VERSION").read_text().strip()
        # Directory names keep to [A-Za-z0-9.+_-]: a Debian version may carry an epoch ("1:2.42").
        dest = root / re.sub(r"[^A-Za-z0-9.+_-]", "_", version)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staged, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    found = _usable(dest / "prometheus", dest / "promtool")
    if found is None:
        raise PrometheusUnavailable(
            f"the binaries unpacked into {dest} do not run (`prometheus --version` failed): "
            f"{_tool_version(dest / 'prometheus')!r}"
        )
    return found


@contextlib.contextmanager
def _fetch_lock() -> Iterator[None]:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / "prometheus.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@functools.cache
def ensure_prometheus() -> PrometheusBinaries:
    """``prometheus`` and ``promtool`` from PATH, the cache, or Debian's package (fetched once per
    machine, under a lock), looked up once per process. Raises `PrometheusUnavailable` naming what
    failed (not remembered: a later call tries again)."""
    found = _on_path() or _cached()
    if found is not None:
        return found
    with _fetch_lock():
        return _cached() or _fetch()  # another process may have fetched them while we waited


# -- promtool -------------------------------------------------------------------------------------


def _promtool(args: Sequence[str], stdin: str | None = None) -> tuple[bool, str]:
    tool = ensure_prometheus().promtool
    proc = subprocess.run(
        [str(tool), *args], input=stdin, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False
    )
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def promtool_check_rules(path: Path) -> tuple[bool, str]:
    """``promtool check rules <path>``: (passed, its output)."""
    return _promtool(["check", "rules", str(path)])


def promtool_test_rules(path: Path) -> tuple[bool, str]:
    """``promtool test rules <path>`` (a rule unit-test file): (passed, its output)."""
    return _promtool(["test", "rules", str(path)])


def promtool_check_metrics(text: str) -> tuple[bool, str]:
    """``promtool check metrics`` on a text exposition: (passed, its lint output)."""
    return _promtool(["check", "metrics"], stdin=text)


# -- the server -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScrapeTarget:
    """One static scrape target. Targets sharing a `job` are one scrape job and must agree on
    scheme, path, TLS and `honor_labels`."""

    job: str
    address: str
    """``host:port``."""
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    metrics_path: str = "/metrics"
    scheme: str = "http"
    ca_file: Path | None = None
    """For ``https``: the CA that signed the target's certificate."""
    honor_labels: bool = False
    """Keep the scraped series' own labels where they clash with `labels` (else Prometheus renames
    theirs ``exported_<name>``), as a ServiceMonitor's ``honorLabels``."""

    def _job_settings(self) -> tuple[str, str, Path | None, bool]:
        return self.metrics_path, self.scheme, self.ca_file, self.honor_labels


@dataclasses.dataclass(frozen=True)
class QueryResult:
    """An instant query's answer: ``result_type`` (vector, scalar, string, matrix) and ``series``
    (each ``{"metric": {...}, "value": [t, "v"]}``; a scalar or string is one entry with no metric)."""

    result_type: str
    series: list[dict[str, Any]]
    warnings: list[str]

    def __bool__(self) -> bool:
        return bool(self.series)


def _scrape_configs(targets: Sequence[ScrapeTarget]) -> list[dict[str, Any]]:
    jobs: dict[str, list[ScrapeTarget]] = {}
    for target in targets:
        jobs.setdefault(target.job, []).append(target)
    configs = []
    for job, members in jobs.items():
        settings = {t._job_settings() for t in members}
        if len(settings) != 1:
            raise ValueError(
                f"scrape job {job!r}: its targets differ in metrics_path, scheme, ca_file or honor_labels"
            )
        path, scheme, ca_file, honor_labels = members[0]._job_settings()
        config: dict[str, Any] = {
            "job_name": job,
            "metrics_path": path,
            "scheme": scheme,
            "honor_labels": honor_labels,
            "static_configs": [{"targets": [t.address], "labels": dict(t.labels)} for t in members],
        }
        if ca_file is not None:
            config["tls_config"] = {"ca_file": str(ca_file)}
        configs.append(config)
    return configs


class PrometheusServer:
    """A ``prometheus`` process scraping `targets` and evaluating `rule_files`.

    ``with PrometheusServer(targets, rule_files=[...]) as prom: prom.query("up")``. ``url`` is its
    base URL once started; its log is ``log_path`` (its tail is in every start-up error).
    """

    def __init__(
        self,
        targets: Sequence[ScrapeTarget],
        *,
        rule_files: Sequence[Path] = (),
        scrape_interval_s: float = 1.0,
        evaluation_interval_s: float = 1.0,
        binaries: PrometheusBinaries | None = None,
        workdir: Path | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self.scrape_targets = list(targets)
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval_s = scrape_interval_s
        self.evaluation_interval_s = evaluation_interval_s
        self.ready_timeout_s = ready_timeout_s
        self._binaries = binaries
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="hamipy-prometheus-"))
        self.config_path = self.workdir / "prometheus.yml"
        self.log_path = self.workdir / "prometheus.log"
        self.port = 0
        self.url = ""
        self._process: ManagedProcess | None = None

    # -- lifecycle

    def config(self) -> dict[str, Any]:
        """The configuration written to ``config_path``."""
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": f"{int(self.evaluation_interval_s * 1000)}ms",
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": _scrape_configs(self.scrape_targets),
        }

    def start(self, *, wait: bool = True) -> None:
        """Write the config and start prometheus; with `wait`, return once it is ready."""
        if self._process is not None:
            raise RuntimeError("prometheus already started")
        binaries = self._binaries or ensure_prometheus()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        tsdb = self.workdir / "data"
        tsdb.mkdir(exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process = ManagedProcess(
            "prometheus",
            [
                str(binaries.prometheus),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={tsdb}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=info",
            ],
            log_path=self.log_path,
            cwd=self.workdir,
        )
        self._process.start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until ``/-/ready`` answers (raises `StartupError` with the log tail otherwise)."""
        if self._process is None:
            raise RuntimeError("prometheus was not started")
        try:
            self._process.wait_healthy(
                http_ok(f"{self.url}/-/ready", expect=b"Ready"), timeout_s=self.ready_timeout_s, what="ready"
            )
        except StartupError:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM prometheus (SIGKILL after a grace period) and remove its directory if we made it."""
        if self._process is not None:
            self._process.stop()
            self._process = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def running(self) -> bool:
        return self._process is not None and self._process.running()

    def log_tail(self) -> str:
        """The last lines of prometheus's log (while its directory exists)."""
        return tail(self.log_path)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the HTTP API

    def _api(self, path: str, params: Mapping[str, str] | None = None, *, post: bool = False) -> Any:
        """``data`` of a ``/api/v1`` answer; raises `PrometheusError` with Prometheus's error text."""
        if not self.url:
            raise RuntimeError("prometheus was not started")
        encoded = urllib.parse.urlencode(params or {})
        url = f"{self.url}/api/v1/{path}"
        request = (
            urllib.request.Request(
                url,
                data=encoded.encode(),
                headers={"Content-Type": "application/x-www-form-urlencoded"},
                method="POST",
            )
            if post
            else urllib.request.Request(f"{url}?{encoded}" if encoded else url)
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=HTTP_TIMEOUT_S) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()  # 400/422/503 answers carry {"status": "error", ...}
            if not body:
                raise PrometheusError(f"GET {path}", "http", f"HTTP {exc.code}") from exc
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise PrometheusError(f"GET {path}", "http", f"not JSON: {body[:200]!r}") from exc
        if not isinstance(answer, dict) or answer.get("status") != "success":
            what = f"{path} {dict(params or {})}"
            if not isinstance(answer, dict):
                raise PrometheusError(what, "http", f"unexpected answer {str(answer)[:200]}")
            raise PrometheusError(what, str(answer.get("errorType", "")), str(answer.get("error", "")))
        return answer.get("data")

    def query(self, expr: str, *, at: float | None = None) -> QueryResult:
        """Evaluate `expr` now (or at unix time `at`); a PromQL error raises `PrometheusError`."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params, post=True)
        kind = str(data["resultType"])
        result = data["result"]
        series = list(result) if kind in ("vector", "matrix") else [{"metric": {}, "value": result}]
        return QueryResult(kind, series, list(data.get("warnings") or []))

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (``/api/v1/targets``): ``labels``, ``health``, ``lastError``..."""
        data = self._api("targets", {"state": "active"})
        return list(data["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        """The rule groups (``/api/v1/rules``), each with its ``rules`` (``health``, ``lastError``...)."""
        return list(self._api("rules")["groups"])

    def alerts(self) -> list[dict[str, Any]]:
        """The pending and firing alerts (``/api/v1/alerts``)."""
        return list(self._api("alerts")["alerts"])

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        """``/api/v1/label/<label>/values``, optionally for series matching `match`."""
        params = {"match[]": match} if match else None
        return [str(v) for v in self._api(f"label/{urllib.parse.quote(label)}/values", params)]

    def wait(
        self,
        predicate: Callable[[], T],
        *,
        timeout_s: float,
        what: str,
        interval_s: float = POLL_INTERVAL_S,
    ) -> T:
        """Poll `predicate` (it may call this server) until truthy; `WaitTimeout` with the last value
        or error seen, and prometheus's log tail if it died."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while True:
            if self._process is not None and not self._process.running():
                raise self._process.fail(f"exited while waiting for {what}")
            try:
                result = predicate()
                if result:
                    return result
                last = result
            except (OSError, ValueError, PrometheusError) as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}; last seen: {last!r}")
            time.sleep(interval_s)


class PrometheusFactory:
    """Starts `PrometheusServer`s on one set of binaries and stops them all at `close` (what the
    ``prometheus_server`` pytest fixture hands a test). ``servers`` are those started."""

    def __init__(self, binaries: PrometheusBinaries) -> None:
        self.binaries = binaries
        self.servers: list[PrometheusServer] = []

    def __call__(
        self,
        targets: Sequence[ScrapeTarget],
        *,
        rule_files: Sequence[Path] = (),
        scrape_interval_s: float = 1.0,
        evaluation_interval_s: float = 1.0,
    ) -> PrometheusServer:
        """A started and ready server (blocks until ``/-/ready``, well under a second here)."""
        server = PrometheusServer(
            targets,
            rule_files=rule_files,
            scrape_interval_s=scrape_interval_s,
            evaluation_interval_s=evaluation_interval_s,
            binaries=self.binaries,
        )
        self.servers.append(server)
        server.start()
        return server

    def close(self) -> None:
        for server in self.servers:
            server.stop()
