"""The node dashboard's slice table finds each container's node by joining its series on
``device_uuid``: with the host GPU's series for a slice of a shared GPU, and with the MIG
instance's series for a container on an instance (whose series carry the instance's MIG UUID, the
device it was given). Evaluated by promtool's PromQL engine (Prometheus's own) on planted series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from by_path import load

from hamipy.devcluster.prometheus import PrometheusBinaries, promtool_test_rules

pytestmark = pytest.mark.integration

dashboard_queries = load("unit/monitor/dashboard_queries.py")

SLICES_PANEL = "Slices on these nodes"
SERIES = [
    ('hami_host_gpu_memory_used_bytes{node="n1",device_uuid="GPU-a"}', "1"),
    ('hami_host_gpu_memory_used_bytes{node="n1",device_uuid="GPU-m"}', "1"),
    ('hami_host_gpu_memory_used_bytes{node="n2",device_uuid="GPU-b"}', "1"),
    (
        'hamipy_monitor_mig_device_memory_total_bytes{node="n1",device_uuid="GPU-m",mig_uuid="MIG-x",'
        'profile="2g.10gb",gpu_instance_id="3",compute_instance_id="0"}',
        "10",
    ),
]
CONTAINERS = {
    "shared": ("n1", "GPU-a", 100),
    "on-mig": ("n1", "MIG-x", 200),
    "elsewhere": ("n2", "GPU-b", 300),
}


def _panel(title: str) -> dict[str, Any]:
    board = dashboard_queries.dashboards()["hamipy-node.json"]
    (found,) = [p for p in dashboard_queries._panels(board["panels"]) if p.get("title") == title]
    panel: dict[str, Any] = found
    return panel


@pytest.mark.parametrize(
    ("ref", "metric"), [("A", "hami_vgpu_memory_limit_bytes"), ("B", "hami_vgpu_memory_used_bytes")]
)
def test_the_slices_on_a_node_include_containers_on_mig_instances(
    prometheus_binaries: PrometheusBinaries, tmp_path: Path, ref: str, metric: str
) -> None:
    (target,) = [t for t in _panel(SLICES_PANEL)["targets"] if t["refId"] == ref]
    series = [
        *SERIES,
        *(
            (
                f'{metric}{{node="{node}",namespace="ns",pod="{pod}",container="c",device_uuid="{uuid}"}}',
                str(value),
            )
            for pod, (node, uuid, value) in CONTAINERS.items()
        ),
    ]
    expected = [
        {"labels": f'{{namespace="ns", pod="{pod}", container="c", device_uuid="{uuid}"}}', "value": value}
        for pod, (node, uuid, value) in CONTAINERS.items()
        if node == "n1"
    ]
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": values} for name, values in series],
                "promql_expr_test": [
                    {
                        # Grafana's $node variable, with one node selected.
                        "expr": target["expr"].replace("$node", "n1"),
                        "eval_time": "0m",
                        "exp_samples": expected,
                    }
                ],
            }
        ],
    }
    test_file = tmp_path / "slices-test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    ok, output = promtool_test_rules(test_file)
    assert ok, output
