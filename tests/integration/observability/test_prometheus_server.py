"""``hamipy.devcluster.prometheus`` itself, on the real binaries: a PromQL error comes back with
Prometheus's own text, rule files are loaded and evaluated (an alert fires), and promtool's verdicts
are returned (no scrape target: Prometheus takes up targets only every 5 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hamipy.devcluster.prometheus import (
    PrometheusBinaries,
    PrometheusError,
    PrometheusFactory,
    promtool_check_metrics,
    promtool_check_rules,
)
from hamipy.devcluster.waiting import wait_for

pytestmark = pytest.mark.integration

RULES = {
    "groups": [
        {
            "name": "test",
            "rules": [
                {"alert": "AlwaysOn", "expr": "vector(1) > 0", "labels": {"severity": "info"}},
                {"record": "test:one", "expr": "vector(1)"},
            ],
        }
    ]
}


async def test_queries_rules_and_alerts(prometheus_server: PrometheusFactory, tmp_path: Path) -> None:
    rule_file = tmp_path / "rules.yaml"
    rule_file.write_text(yaml.safe_dump(RULES))
    prom = prometheus_server([], rule_files=[rule_file])

    answer = prom.query("vector(2) * 3")
    assert answer.result_type == "vector"
    assert [s["value"][1] for s in answer.series] == ["6"]
    assert prom.query("scalar(vector(1))").result_type == "scalar"
    assert not prom.query("absent_series_here")
    with pytest.raises(PrometheusError, match="parse error") as caught:
        prom.query("sum(")
    assert caught.value.error_type == "bad_data"

    def firing() -> bool:
        return [a["labels"]["alertname"] for a in prom.alerts() if a["state"] == "firing"] == ["AlwaysOn"]

    await wait_for(firing, timeout=15, interval=0.2, what="AlwaysOn firing")
    (group,) = prom.rules()
    assert [r["health"] for r in group["rules"]] == ["ok", "ok"]
    assert prom.targets() == []
    prom.stop()
    assert not prom.running()


def test_promtool_verdicts(prometheus_binaries: PrometheusBinaries, tmp_path: Path) -> None:
    ok, out = promtool_check_metrics("# HELP x_seconds A counter.\n# TYPE x_seconds counter\nx_seconds 1\n")
    assert not ok
    assert 'x_seconds counter metrics should have "_total" suffix' in out
    ok, out = promtool_check_metrics("# HELP x_total A counter.\n# TYPE x_total counter\nx_total 1\n")
    assert ok, out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "sum("}]}]}))
    ok, out = promtool_check_rules(bad)
    assert not ok
    assert "parse error" in out
