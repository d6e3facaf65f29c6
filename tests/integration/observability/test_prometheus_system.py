"""A real Prometheus scraping a running system.

One system (webhook, extender, a GPU node with the device plugin and the monitor) and one Prometheus
scraping all four with the alert rules of deploy/helm/hami-py/files/alerts.yaml loaded, both at a
1 s interval. A workload that touches every dashboard panel: GPU pods admitted, filtered, bound and
served in two rounds (the second while Prometheus scrapes, so rates see it), one container holding GPU
memory and launching a kernel (through the interposer over the fake driver), one whose region file
is junk for a moment (a region error), containers that never start CUDA. Then:

- every service's ``/metrics`` passes ``promtool check metrics``;
- every query of every panel of every dashboard in deploy/grafana (a ResourceQuota gives the quota
  panels theirs), and every template variable
  (``label_values``), evaluates without error and returns data;
- every alert expression evaluates without error, the rules API shows each rule healthy, and no
  alert is pending or firing;
- a planted first error (a body that is not JSON POSTed to the webhook) makes
  ``HamipyWebhookBadRequests`` fire.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
import yaml
from builders import container
from by_path import load
from observability_support import ObservedSystem, monitor_support
from stack_support import NEEDS_REAL_KUBELET

from hamipy.devcluster import wait_for
from hamipy.devcluster.prometheus import (
    PrometheusError,
    PrometheusFactory,
    PrometheusServer,
    ScrapeTarget,
    promtool_check_metrics,
)

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "deploy" / "helm" / "hami-py" / "files" / "alerts.yaml"
PLANTED_ALERT = "HamipyWebhookBadRequests"
REGION_ERRORS = "hamipy_monitor_region_errors_total"
# Grafana's built-in interval variables, as a dashboard at a 1 s scrape interval would get them.
BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__interval_ms": "60000", "__range": "5m"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),\s*)?([a-zA-Z_]\w*)\s*\)\s*$", re.DOTALL)
DATA_TIMEOUT_S = 30.0
PROGRAM_TIMEOUT_S = 30.0
# promtool's lint findings on names kept for HAMi compatibility (its dashboards and users query them).
ACCEPTED_LINT = frozenset(
    {'hami_gpu_shared_count non-histogram and non-summary metrics should not have "_count" suffix'}
)

T = TypeVar("T")


dashboard_queries = load("unit/monitor/dashboard_queries.py")


async def call(fn: Callable[..., T], *args: Any) -> T:
    """A blocking Prometheus API call off the event loop, which serves the webhook and extender
    Prometheus scrapes meanwhile."""
    return await asyncio.to_thread(fn, *args)


# -- Grafana's side: variables and queries -------------------------------------------------------


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace ``$var``, ``${var}``, ``${var:fmt}`` and ``[[var]]`` as Grafana does (one value each);
    an unknown name stays as it is (as in Grafana: ``$1`` of ``label_replace``, or a typo that
    Prometheus then refuses)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        return values.get(name, match.group(0))

    return _VARIABLE.sub(one, expr)


def resolve_variables(dashboard: dict[str, Any], prom: PrometheusServer) -> tuple[dict[str, str], list[str]]:
    """The variables' values as Grafana's defaults would pick them ("All": ``allValue``), and the
    problems met: a variable query that fails or finds no value."""
    values = dict(BUILTINS)
    problems = []
    for var in (dashboard.get("templating") or {}).get("list") or []:
        name, kind = var["name"], var.get("type")
        if kind == "datasource":
            values[name] = "prometheus"
            continue
        if kind != "query":
            raise AssertionError(f"variable ${name}: type {kind!r} is not handled by this test")
        query = var.get("query")
        text = substitute(query.get("query", "") if isinstance(query, dict) else str(query), values)
        parsed = _LABEL_VALUES.match(text)
        if parsed is None:
            raise AssertionError(f"variable ${name}: {text!r} is not label_values(...)")
        selector, label = parsed.group(1), parsed.group(2)
        try:
            found = prom.label_values(label, selector)
        except PrometheusError as exc:
            problems.append(f"variable ${name}: {text}: {exc}")
            found = []
        if not found:
            problems.append(f"variable ${name}: {text}: no values")
        if var.get("includeAll"):
            values[name] = var.get("allValue") or "(" + "|".join(map(re.escape, found)) + ")"
        else:
            values[name] = found[0] if found else ""
    return values, problems


def dashboard_problems(prom: PrometheusServer) -> list[str]:
    """Every panel query of every dashboard, with its variables resolved: the ones that fail or
    return no data (a NaN answer counts as no data)."""
    problems = []
    for file, board in dashboard_queries.dashboards().items():
        values, var_problems = resolve_variables(board, prom)
        problems += [f"{file}: {p}" for p in var_problems]
        for raw in dashboard_queries.queries(board):
            expr = substitute(raw, values)
            try:
                result = prom.query(expr)
            except PrometheusError as exc:
                problems.append(f"{file}: {expr}: error {exc.error_type}: {exc.error}")
                continue
            values_seen = [s["value"][1] for s in result.series if "value" in s]
            if not result.series:
                problems.append(f"{file}: {expr}: no data")
            elif all(v == "NaN" for v in values_seen):
                problems.append(f"{file}: {expr}: NaN only")
    return problems


# -- the system's side ----------------------------------------------------------------------------


def _address(url: str) -> str:
    return urlsplit(url).netloc


def scrape_targets(system: ObservedSystem) -> list[ScrapeTarget]:
    """The four services, with the target labels the Prometheus operator gives a ServiceMonitor's
    targets, and its ``honorLabels`` as the chart sets it (true where series carry a tenant pod's
    namespace/pod/container: the extender and the monitor)."""
    s = system.stack

    def target(job: str, address: str, honor: bool) -> ScrapeTarget:
        labels = {"namespace": "hami-system", "service": job, "pod": f"{job}-0"}
        return ScrapeTarget(job, address, labels, honor_labels=honor)

    return [
        target("hamipy-extender", _address(s.extender.url), True),
        target("hamipy-webhook", f"127.0.0.1:{system.webhook.metrics_port}", False),
        target("hamipy-device-plugin", f"127.0.0.1:{s.plugin.metrics_port}", False),
        target("hamipy-monitor", _address(s.monitor.url), True),
    ]


def launch_once(container: Any) -> subprocess.Popen[str]:
    """One kernel launch through the interposer (``launch_paths_are_throttled once``): the region
    gets its ``recent_kernel`` mark and ``last_kernel_time``; the program waits on stdin after."""
    program = container.plugin.native_build / "tests" / "launch_paths_are_throttled"
    # Not throttled: what is wanted is the launch's mark in the region, and on a loaded machine
    # an SM-limited first launch may wait for utilization samples longer than the test does.
    proc = subprocess.Popen(
        [str(program), "once", "cuLaunchKernel"],
        env={**container.env(), "GPU_CORE_UTILIZATION_POLICY": "disable"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = monitor_support.read_lines(proc, 2)
    if lines != ["launching", "launched rc=0"]:
        proc.kill()
        _, err = proc.communicate(timeout=PROGRAM_TIMEOUT_S)
        raise AssertionError(f"the kernel launch failed: {lines}; stderr:\n{err}")
    return proc


def post_not_json(port: int, ca_file: Path) -> int:
    """POST a body that is not JSON to the webhook over TLS, as something other than the API
    server might; return the HTTP status."""
    context = ssl.create_default_context(cafile=str(ca_file))
    request = urllib.request.Request(
        f"https://127.0.0.1:{port}/webhook",
        data=b"this is not an AdmissionReview",
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    try:
        with opener.open(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def rule_health(prom: PrometheusServer) -> dict[str, tuple[str, str]]:
    """Each rule's (health, lastError), once every rule has been evaluated (else empty)."""
    seen = {}
    for group in prom.rules():
        for rule in group["rules"]:
            if rule.get("health") == "unknown":
                return {}
            seen[rule["name"]] = (rule["health"], rule.get("lastError", ""))
    return seen


# -- the test ---------------------------------------------------------------------------------------


def has_series(prom: PrometheusServer, *exprs: str) -> bool:
    return all(prom.query(expr) for expr in exprs)


async def test_prometheus_scrapes_the_system_dashboards_and_alerts_work(
    observed_system: ObservedSystem, prometheus_server: PrometheusFactory
) -> None:
    system = observed_system
    s = system.stack
    prom = prometheus_server(scrape_targets(system), rule_files=[ALERTS])
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]

    # The workload's first round, while Prometheus takes up its targets (it applies a new target
    # set at most every 5 s): a container that holds GPU memory and launches a kernel, and one
    # whose region file is junk until the monitor has counted it (the "Region errors" panel), then
    # gone again (so no alert is left pending).
    # A namespace GPU quota with room for the workload (the "GPU quotas per namespace" panels).
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpu"},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "65536", "limits.nvidia.com/gpucores": "400"}},
    }
    await s.core.create_namespaced_resource_quota(s.namespace, quota, _request_timeout=30)
    await wait_for(
        lambda: bool(s.extender.model.quotas.limits(s.namespace)), timeout=30, what="the quota seen"
    )
    await s.create("busy", [container("main", gpu=1, gpumem=3000, gpucores=30)])
    await s.create("broken", [container("main", gpu=1, gpumem=1000)])
    await s.served("busy")
    await s.served("broken")
    busy, broken = await s.container("busy", "main"), await s.container("broken", "main")
    holder = busy.hold(64)
    try:
        launcher = await asyncio.to_thread(launch_once, busy)
    except BaseException:
        monitor_support.release(holder)
        raise
    try:
        await asyncio.to_thread(broken.region_file.write_bytes, b"not a region file" * 256)
        try:

            async def junk_counted() -> bool:
                errors: list[float] = [
                    v for (name, _), v in (await s.monitor.scrape()).items() if name == REGION_ERRORS
                ]
                return sum(errors) > 0

            await wait_for(junk_counted, timeout=15, what="the junk region file counted by the monitor")
        finally:
            await asyncio.to_thread(broken.region_file.unlink)

        # promtool's lint of each service's exposition, taken while the workload runs.
        texts = {
            "extender": await monitor_support.scrape_text(f"{s.extender.url}/metrics"),
            "webhook": await monitor_support.scrape_text(
                f"http://127.0.0.1:{system.webhook.metrics_port}/metrics"
            ),
            "device plugin": await monitor_support.scrape_text(
                f"http://127.0.0.1:{s.plugin.metrics_port}/metrics"
            ),
            "monitor": await monitor_support.scrape_text(f"{s.monitor.url}/metrics"),
        }
        lint = {}
        for name, text in texts.items():
            ok, output = await call(promtool_check_metrics, text)
            found = [line for line in output.splitlines() if line not in ACCEPTED_LINT]
            if not ok and found:
                lint[name] = found

        def all_up() -> bool:
            health = {t["labels"]["job"]: t["health"] for t in prom.targets()}
            return len(health) == 4 and set(health.values()) == {"up"}

        await wait_for(lambda: call(all_up), timeout=30, interval=0.2, what="every scrape target up")
        # The second round, once Prometheus scrapes: the first round happened before its first
        # scrape, and rate() sees only what happens between two samples; this pod's admission,
        # filter, bind and Allocate are what the latency panels show. Its container never starts CUDA.
        first_round = (
            "hamipy_extender_filter_duration_seconds_count",
            "hamipy_extender_bind_duration_seconds_count",
            "hamipy_device_plugin_allocate_duration_seconds_count",
        )
        await wait_for(lambda: call(has_series, prom, *first_round), timeout=15, what="first round scraped")
        await s.create("late", [container("main", gpu=1, gpumem=1000)])
        await s.served("late")
        await s.container("late", "main")

        # Every dashboard query and variable answers with data (rates need two scrapes after the
        # workload's events: poll until all have data or time runs out).
        with contextlib.suppress(TimeoutError):  # then the problems are reported below
            await wait_for(
                lambda: call(lambda: not dashboard_problems(prom)),
                timeout=DATA_TIMEOUT_S,
                interval=0.5,
                what="every dashboard query to return data",
            )
        dashboards = await call(dashboard_problems, prom)

        # Every alert expression evaluates and every rule is healthy.
        alert_errors = []
        for rule in rules:
            try:
                await call(prom.query, rule["expr"])
            except PrometheusError as exc:
                alert_errors.append(f"{rule['alert']}: {exc.error_type}: {exc.error}")
        health = await wait_for(lambda: call(rule_health, prom), timeout=15, what="every rule evaluated")
        unhealthy = {name: h for name, h in health.items() if h[0] != "ok"}
    finally:
        launcher.communicate(timeout=PROGRAM_TIMEOUT_S)
        monitor_support.release(holder)

    assert {r["alert"] for r in rules} <= set(health), health
    problems = [f"promtool check metrics, {name}: {line}" for name, out in lint.items() for line in out]
    problems += [f"dashboard query: {p}" for p in dashboards]
    problems += [f"alert expression: {p}" for p in alert_errors]
    problems += [f"rule {name}: health {h}: {err}" for name, (h, err) in unhealthy.items()]
    assert not problems, "\n".join(problems)

    # Nothing pending or firing before the first error (were the junk region file scraped, the
    # alert it made pending is gone once the file is).
    async def quiet() -> bool:
        return not await call(prom.alerts)

    await wait_for(quiet, timeout=10, interval=0.2, what="no alert pending or firing before any error")

    # A first error: a request that is not an AdmissionReview. Its alert fires (no `for`).
    assert await asyncio.to_thread(post_not_json, system.webhook.port, system.webhook.ca_file) == 400

    def planted() -> list[dict[str, Any]]:
        return [a for a in prom.alerts() if a["labels"].get("alertname") == PLANTED_ALERT]

    fired = await wait_for(lambda: call(planted), timeout=20, interval=0.2, what=f"alert {PLANTED_ALERT}")
    assert [a["state"] for a in fired] in (["firing"], ["pending"]), fired
    (alert,) = fired
    assert alert["labels"]["severity"] == "warning"
    assert alert["labels"]["job"] == "hamipy-webhook"
    assert alert["labels"]["pod"] == "hamipy-webhook-0"
    assert alert["labels"]["reason"], alert
    others = [a["labels"]["alertname"] for a in await call(prom.alerts) if a not in fired]
    assert others == [], f"other alerts besides the planted one: {others}"
