"""The alert rules pass ``promtool check rules``: the plain rule file
(deploy/helm/hami-py/files/alerts.yaml, what to load without the Prometheus operator) and the
PrometheusRule the chart renders from it (its ``spec`` is a rule file)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hamipy.devcluster.binaries import KUBERNETES_VERSION, ensure_helm
from hamipy.devcluster.prometheus import PrometheusBinaries, promtool_check_rules, promtool_test_rules

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "deploy" / "helm" / "hami-py"
ALERTS = CHART / "files" / "alerts.yaml"


def _alert_names(groups: list[dict[str, Any]]) -> list[str]:
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_rule_file_passes_promtool(prometheus_binaries: PrometheusBinaries) -> None:
    ok, output = promtool_check_rules(ALERTS)
    assert ok, output
    assert "SUCCESS" in output


def test_the_charts_prometheus_rule_passes_promtool(
    prometheus_binaries: PrometheusBinaries, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            str(ensure_helm()),
            "template",
            "hami-py",
            str(CHART),
            "--namespace",
            "hami-system",
            "--kube-version",
            KUBERNETES_VERSION.lstrip("v"),
            "--set",
            "prometheusRule.enabled=true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (rule,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d.get("kind") == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    rule_file = tmp_path / "prometheus-rule.yaml"
    rule_file.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    ok, output = promtool_check_rules(rule_file)
    assert ok, output
    # The same alerts as the plain file, with Prometheus's own templates ($labels, $value) intact.
    plain = yaml.safe_load(ALERTS.read_text())
    assert rule["spec"]["groups"] == plain["groups"]
    assert _alert_names(rule["spec"]["groups"]), "no alerts rendered"


def test_connections_turned_away_fire_and_evictions_do_not(
    prometheus_binaries: PrometheusBinaries, tmp_path: Path
) -> None:
    # Evicting idle or slow connections is the cap doing its job against tenants; refusing one, or
    # letting one time out in the queue, may have failed kube-scheduler's or the API server's call.
    alert = "HamipyConnectionsTurnedAway"
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r.get("alert") == alert]
    rule.pop("annotations")  # promtool compares them too; the expression and labels are tested here
    rules = tmp_path / "rule.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "one", "rules": [rule]}]}))
    closed = 'hamipy_{}_http_connections_closed_total{{pod="{}",server="api",reason="{}"}}'
    series = [
        (closed.format("extender", "ext-0", "refused"), "0 0 0 3 3 3"),
        (closed.format("extender", "ext-0", "evicted"), "0 5 9 12 15 20"),
        (closed.format("extender", "ext-1", "header_timeout"), "0 1 2 3 4 5"),
        (closed.format("webhook", "wh-0", "queue_timeout"), "_ _ _ 1 1 1"),  # born at 1
    ]
    fired = [
        {"severity": "warning", "pod": pod, "server": "api", "reason": why}
        for pod, why in (("ext-0", "refused"), ("wh-0", "queue_timeout"))
    ]
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": values} for name, values in series],
                "alert_rule_test": [
                    {"eval_time": "2m", "alertname": alert, "exp_alerts": []},
                    {
                        "eval_time": "4m",
                        "alertname": alert,
                        "exp_alerts": [{"exp_labels": labels} for labels in fired],
                    },
                ],
            }
        ],
    }
    test_file = tmp_path / "connections-test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    ok, output = promtool_test_rules(test_file)
    assert ok, output
