"""A real Prometheus for the tests: find or build ``prometheus``/``promtool``, run a server that
scrapes static targets or what Kubernetes service discovery finds, evaluates rule files, query it,
and lint with promtool.

Binaries, at ``PROMETHEUS_VERSION`` (`hamipy.devcluster.binaries`): ``prometheus`` and ``promtool``
on ``PATH`` when they are that release, else those built once per machine from the Go module proxy
into the cache with Kubernetes service discovery (Debian's package lacks it), under the binaries'
build lock. When none can be had, `ensure_prometheus` raises `PrometheusUnavailable` saying why (the
pytest fixtures turn that into a skip with that reason).

`PrometheusServer` is a context manager: it writes a config with one scrape job per `ScrapeTarget`
job name and the raw scrape configs it is given (those of `hamipy.devcluster.prometheus_operator`
for the chart's ServiceMonitors: their Kubernetes service discovery gets the dev cluster's API
server and client certificate, `ApiServerAccess`), short scrape and evaluation intervals and the
given rule files, starts ``prometheus`` on a free loopback port with a temporary TSDB, waits for
``/-/ready`` and stops it with SIGTERM, then SIGKILL. Its API calls (`query`, `targets`, `rules`,
`alerts`) are blocking HTTP requests with a timeout: from an async test whose event loop also serves
a scraped target, call them through ``asyncio.to_thread`` so the loop keeps answering the scrapes.
"""

from __future__ import annotations

import copy
import dataclasses
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

import yaml

from hamipy.devcluster.binaries import PROMETHEUS_VERSION, ensure_prometheus_build
from hamipy.devcluster.errors import BinaryBuildError, DevClusterError, StartupError, WaitTimeout
from hamipy.devcluster.processes import ManagedProcess, free_port, http_ok, tail

__all__ = [
    "ApiServerAccess",
    "PrometheusBinaries",
    "PrometheusError",
    "PrometheusFactory",
    "PrometheusServer",
    "PrometheusUnavailable",
    "QueryResult",
    "ScrapeTarget",
    "ensure_prometheus",
    "promtool_check_config",
    "promtool_check_metrics",
    "promtool_check_rules",
    "promtool_test_rules",
]

TOOL_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.2

T = TypeVar("T")


class PrometheusUnavailable(BinaryBuildError):
    """``prometheus``/``promtool`` at ``PROMETHEUS_VERSION`` are not on PATH nor cached and could not
    be built; the message says why."""


class PrometheusError(DevClusterError):
    """The Prometheus HTTP API answered an error (a PromQL error carries Prometheus's own text), or
    reports one (a rule that failed to evaluate)."""

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


# -- finding and building the binaries -------------------------------------------------------------


def _tool_version(binary: Path) -> str:
    """``3.16.0`` from "prometheus, version 3.16.0 (branch: ...)", or "" if it does not run."""
    try:
        proc = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    found = re.search(r"version\s+(\S+)", proc.stdout + proc.stderr)
    return found.group(1) if proc.returncode == 0 and found else ""


def _usable(prometheus: Path, promtool: Path) -> PrometheusBinaries | None:
    """The pair, if both run and are ``PROMETHEUS_VERSION``."""
    want = PROMETHEUS_VERSION.removeprefix("v")
    for binary in (prometheus, promtool):
        if not binary.is_file() or not os.access(binary, os.X_OK) or _tool_version(binary) != want:
            return None
    return PrometheusBinaries(prometheus=prometheus, promtool=promtool, version=want)


@functools.cache
def ensure_prometheus() -> PrometheusBinaries:
    """``prometheus`` and ``promtool`` at ``PROMETHEUS_VERSION``, from PATH or built into the cache
    (once per machine), looked up once per process. Raises `PrometheusUnavailable` saying why (not
    remembered: a later call tries again)."""
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is not None and promtool is not None:
        found = _usable(Path(prometheus), Path(promtool))
        if found is not None:
            return found
    try:
        built = ensure_prometheus_build()
    except BinaryBuildError as exc:
        raise PrometheusUnavailable(str(exc)) from exc
    found = _usable(built / "prometheus", built / "promtool")
    if found is None:
        raise PrometheusUnavailable(f"the binaries in {built} do not run as Prometheus {PROMETHEUS_VERSION}")
    return found


# -- promtool -------------------------------------------------------------------------------------


def _promtool(args: Sequence[str], stdin: str | None = None) -> tuple[bool, str]:
    tool = ensure_prometheus().promtool
    proc = subprocess.run(
        [str(tool), *args], input=stdin, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False
    )
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def promtool_check_config(path: Path) -> tuple[bool, str]:
    """``promtool check config <path>`` (a prometheus.yml, with the rule files and TLS files it
    names): (passed, its output)."""
    return _promtool(["check", "config", str(path)])


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


class ApiServerAccess(Protocol):
    """Where Kubernetes service discovery reaches the API server, with which client certificate
    (the dev cluster's `ClusterAccess` is one)."""

    @property
    def server(self) -> str: ...
    @property
    def ca_file(self) -> Path: ...
    @property
    def cert_file(self) -> Path: ...
    @property
    def key_file(self) -> Path: ...


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


def _on_api_server(config: Mapping[str, Any], access: ApiServerAccess | None) -> dict[str, Any]:
    """`config` with the API server and client certificate in each of its kubernetes_sd_configs
    that names none (inside a cluster Prometheus would find its own; here there is none to find)."""
    placed = copy.deepcopy(dict(config))
    for sd in placed.get("kubernetes_sd_configs") or []:
        if "api_server" in sd:
            continue
        if access is None:
            raise ValueError(
                f"scrape job {config.get('job_name')!r}: its kubernetes_sd_configs name no api_server; "
                "pass kubernetes= (the cluster's address and client certificate)"
            )
        sd["api_server"] = access.server
        sd["tls_config"] = {
            "ca_file": str(access.ca_file),
            "cert_file": str(access.cert_file),
            "key_file": str(access.key_file),
        }
    return placed


class PrometheusServer:
    """A ``prometheus`` process scraping `targets` and the jobs of `scrape_configs` (Prometheus's
    own format; their Kubernetes service discovery reaches the API server of `kubernetes`), and
    evaluating `rule_files`.

    ``with PrometheusServer(targets, rule_files=[...]) as prom: prom.query("up")``. ``url`` is its
    base URL once started; its log is ``log_path`` (its tail is in every start-up error).
    """

    def __init__(
        self,
        targets: Sequence[ScrapeTarget] = (),
        *,
        scrape_configs: Sequence[Mapping[str, Any]] = (),
        kubernetes: ApiServerAccess | None = None,
        rule_files: Sequence[Path] = (),
        scrape_interval_s: float = 1.0,
        evaluation_interval_s: float = 1.0,
        binaries: PrometheusBinaries | None = None,
        workdir: Path | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self.scrape_targets = list(targets)
        self.scrape_configs = [dict(c) for c in scrape_configs]
        self.kubernetes = kubernetes
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
        """The configuration written to ``config_path``; `ValueError` for two jobs of one name or a
        Kubernetes service discovery with no API server to reach."""
        jobs = _scrape_configs(self.scrape_targets) + [
            _on_api_server(c, self.kubernetes) for c in self.scrape_configs
        ]
        names = [str(job.get("job_name")) for job in jobs]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"scrape jobs named more than once: {', '.join(twice)}")
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": f"{int(self.evaluation_interval_s * 1000)}ms",
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": jobs,
        }

    def write_config(self) -> Path:
        """Write `config` to ``config_path`` (what `start` runs on; ``promtool check config`` takes it)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        return self.config_path

    def start(self, *, wait: bool = True) -> None:
        """Write the config and start prometheus; with `wait`, return once it is ready."""
        if self._process is not None:
            raise RuntimeError("prometheus already started")
        binaries = self._binaries or ensure_prometheus()
        self.write_config()
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

    def rule_problems(self) -> list[str] | None:
        """None while a rule has not been evaluated yet; then what is wrong, empty if nothing: a
        group of `rule_files` that is not loaded, a rule whose health is not "ok" (with its
        ``lastError``)."""
        groups = self.rules()
        if any(rule.get("health") == "unknown" for group in groups for rule in group["rules"]):
            return None
        loaded = {(group["file"], group["name"]) for group in groups}
        problems = [
            f"{file}: group {name!r} is not loaded"
            for file in self.rule_files
            for name in [g["name"] for g in yaml.safe_load(file.read_text())["groups"]]
            if (str(file), name) not in loaded
        ]
        for group in groups:
            for rule in group["rules"]:
                if rule.get("health") != "ok" or rule.get("lastError"):
                    problems.append(
                        f"{group['file']}: {group['name']}/{rule['name']}: {rule.get('health')}: "
                        f"{rule.get('lastError', '')}"
                    )
        return problems

    def wait_rules_healthy(self, *, timeout_s: float) -> None:
        """Wait until every rule has been evaluated once; `PrometheusError` listing each problem of
        `rule_problems`, if any."""

        def evaluated() -> tuple[list[str], ...]:
            problems = self.rule_problems()
            return () if problems is None else (problems,)  # () is falsy: not yet

        problems = self.wait(evaluated, timeout_s=timeout_s, what="every rule evaluated once")[0]
        if problems:
            raise PrometheusError("rules", "unhealthy", "\n".join(problems))

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
        targets: Sequence[ScrapeTarget] = (),
        *,
        scrape_configs: Sequence[Mapping[str, Any]] = (),
        kubernetes: ApiServerAccess | None = None,
        rule_files: Sequence[Path] = (),
        scrape_interval_s: float = 1.0,
        evaluation_interval_s: float = 1.0,
    ) -> PrometheusServer:
        """A started and ready server (blocks until ``/-/ready``, well under a second here)."""
        server = PrometheusServer(
            targets,
            scrape_configs=scrape_configs,
            kubernetes=kubernetes,
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
