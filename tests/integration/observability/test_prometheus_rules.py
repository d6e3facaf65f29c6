"""The alert rules pass ``promtool check rules`` (issue 14 item 6): the plain rule file
(deploy/helm/hami-py/files/alerts.yaml, what to load without the Prometheus operator) and the
PrometheusRule the chart renders from it (its ``spec`` is a rule file)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hamipy.devcluster.binaries import KUBERNETES_VERSION, ensure_helm
from hamipy.devcluster.prometheus import PrometheusBinaries, promtool_check_rules

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
