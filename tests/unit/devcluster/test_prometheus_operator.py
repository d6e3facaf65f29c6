"""The Prometheus operator's translation of the chart's monitoring objects
(``hamipy.devcluster.prometheus_operator``): the chart rendered by the pinned helm with every
ServiceMonitor and the PrometheusRule on, translated, and the scrape configs checked for what they
select (a job's keep/drop relabelings applied to the rendered Services' ports: exactly the chart's
metrics port of its service), the operator's target labels, ``honor_labels`` where the chart says,
and ``promtool check config`` accepting the prometheus.yml `PrometheusServer` writes of them with the
PrometheusRule's rule file. Hand-written ServiceMonitors pin the selector forms the chart does not
use, as the operator's golden files have them, and what is refused."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_values import CHART, helm_template

from hamipy.devcluster.errors import BinaryBuildError
from hamipy.devcluster.prometheus import PrometheusBinaries, PrometheusServer, promtool_check_config
from hamipy.devcluster.prometheus_operator import (
    MonitoringObjectError,
    job_name,
    rule_file_content,
    scrape_configs,
    service_monitor_scrape_configs,
    write_rule_files,
)

# helm and promtool run here (a second or two each on a loaded machine).
pytestmark = pytest.mark.timeout(120)

NAMESPACE = "hami-system"
VALUES_KEYS = ("webhook", "extender", "devicePlugin", "monitor")
# ServiceMonitor name -> (the Service it must scrape, honorLabels, a DaemonSet's: one target per node).
# honorLabels where the series carry tenant pods' namespace, pod and container (docs/install.md).
EXPECTED = {
    "hami-py-webhook": ("hami-py-webhook", False, False),
    "hami-py-extender": ("hami-py-extender-metrics", True, False),
    "hami-py-device-plugin": ("hami-py-device-plugin", False, True),
    "hami-py-monitor": ("hami-py-monitor", True, True),
}
OPERATOR_LABELS = {"namespace", "service", "pod", "container", "node", "job", "endpoint"}
NODE_LABEL = {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"}


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    args = [a for key in VALUES_KEYS for a in ("--set", f"{key}.serviceMonitor.enabled=true")]
    try:
        proc = helm_template(*args, "--set", "prometheusRule.enabled=true", namespace=NAMESPACE)
    except BinaryBuildError as exc:
        pytest.skip(f"no helm to render the chart: {exc}")
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module")
def jobs(rendered: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {config["job_name"]: config for config in scrape_configs(rendered)}


def _service_ports(rendered: list[dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
    """(service name, the meta labels endpointslice discovery gives its endpoints on that port)."""
    found = []
    for doc in rendered:
        if doc["kind"] != "Service":
            continue
        meta = {"__meta_kubernetes_namespace": doc["metadata"]["namespace"]}
        meta["__meta_kubernetes_service_name"] = doc["metadata"]["name"]
        for key, value in doc["metadata"]["labels"].items():
            name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
            meta[f"__meta_kubernetes_service_label_{name}"] = value
            meta[f"__meta_kubernetes_service_labelpresent_{name}"] = "true"
        for port in doc["spec"]["ports"]:
            found.append(
                (doc["metadata"]["name"], {**meta, "__meta_kubernetes_endpointslice_port_name": port["name"]})
            )
    return found


def _kept(config: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether the job's keep and drop steps let a target with these labels through (as Prometheus
    applies them: the source values joined by the separator, the regex anchored)."""
    for step in config["relabel_configs"]:
        if step.get("action") not in ("keep", "drop"):
            continue
        value = step.get("separator", ";").join(labels.get(name, "") for name in step["source_labels"])
        if (re.fullmatch(step["regex"], value) is not None) != (step["action"] == "keep"):
            return False
    return True


# -- the chart's ServiceMonitors ---------------------------------------------------------------------


def test_one_job_per_service_monitor_endpoint(
    rendered: list[dict[str, Any]], jobs: dict[str, dict[str, Any]]
) -> None:
    monitors = [d for d in rendered if d["kind"] == "ServiceMonitor"]
    assert {d["metadata"]["name"] for d in monitors} == set(EXPECTED)
    expected = {
        job_name(NAMESPACE, d["metadata"]["name"], i)
        for d in monitors
        for i, _ in enumerate(d["spec"]["endpoints"])
    }
    assert set(jobs) == expected
    for config in jobs.values():
        (sd,) = config["kubernetes_sd_configs"]
        assert sd == {"role": "endpointslice", "namespaces": {"names": [NAMESPACE]}}
        assert config["metrics_path"] == "/metrics"


@pytest.mark.parametrize("monitor", list(EXPECTED))
def test_a_job_scrapes_its_service_metrics_port_only(
    rendered: list[dict[str, Any]], jobs: dict[str, dict[str, Any]], monitor: str
) -> None:
    service, honor, per_node = EXPECTED[monitor]
    config = jobs[job_name(NAMESPACE, monitor, 0)]
    kept = [
        (name, labels["__meta_kubernetes_endpointslice_port_name"])
        for name, labels in _service_ports(rendered)
        if _kept(config, labels)
    ]
    assert kept == [(service, "metrics")]
    assert config["honor_labels"] is honor
    targets = {step.get("target_label") for step in config["relabel_configs"]}
    assert targets >= OPERATOR_LABELS
    assert {"target_label": "endpoint", "replacement": "metrics"} in config["relabel_configs"]
    # The chart's own relabeling comes after the operator's, so its `node` is the pod's node.
    assert (config["relabel_configs"][-1] == NODE_LABEL) is per_node


def test_service_monitor_intervals_and_metric_relabelings(jobs: dict[str, dict[str, Any]]) -> None:
    assert jobs[job_name(NAMESPACE, "hami-py-monitor", 0)]["scrape_interval"] == "15s"
    assert jobs[job_name(NAMESPACE, "hami-py-webhook", 0)]["scrape_interval"] == "30s"
    # An empty replacement is kept: it clears the tenant series' container (the default is "$1").
    assert jobs[job_name(NAMESPACE, "hami-py-extender", 0)]["metric_relabel_configs"] == [
        {
            "source_labels": ["__name__"],
            "target_label": "container",
            "regex": "hami_vgpu_.*",
            "replacement": "",
        }
    ]
    assert "metric_relabel_configs" not in jobs[job_name(NAMESPACE, "hami-py-webhook", 0)]


def test_prometheus_rule_file_is_the_alerts_file(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    (path,) = write_rule_files(rendered, tmp_path)
    assert path.name == f"{NAMESPACE}-hami-py-alerts.yaml"
    assert yaml.safe_load(path.read_text()) == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())


@dataclasses.dataclass(frozen=True)
class Access:
    server: str
    ca_file: Path
    cert_file: Path
    key_file: Path


def test_promtool_accepts_the_prometheus_config(
    prometheus_binaries: PrometheusBinaries, rendered: list[dict[str, Any]], tmp_path: Path
) -> None:
    files = [tmp_path / name for name in ("ca.crt", "client.crt", "client.key")]
    for file in files:
        file.write_text("")  # promtool checks that they exist
    access = Access("https://127.0.0.1:6443", *files)
    server = PrometheusServer(
        scrape_configs=scrape_configs(rendered),
        kubernetes=access,
        rule_files=write_rule_files(rendered, tmp_path / "rules"),
        workdir=tmp_path / "prometheus",
    )
    config = yaml.safe_load(server.write_config().read_text())
    for job in config["scrape_configs"]:
        (sd,) = job["kubernetes_sd_configs"]
        assert sd["api_server"] == access.server
        assert sd["tls_config"] == {
            "ca_file": str(files[0]),
            "cert_file": str(files[1]),
            "key_file": str(files[2]),
        }
    ok, out = promtool_check_config(server.config_path)
    assert ok, out
    assert "SUCCESS" in out


# -- selector forms and refusals ------------------------------------------------------------------


def monitor(spec: dict[str, Any], *, name: str = "test", namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"endpoints": [{"port": "web"}], **spec},
    }


def test_match_expressions_and_namespaces_as_the_operator_writes_them() -> None:
    # The operator's MatchExpressionsServiceMonitor golden file, and the other three operators.
    spec = {
        "selector": {
            "matchExpressions": [
                {"key": "alpha", "operator": "In", "values": ["beta", "gamma"]},
                {"key": "app.kubernetes.io/tier", "operator": "NotIn", "values": ["db"]},
                {"key": "team", "operator": "Exists"},
                {"key": "legacy", "operator": "DoesNotExist"},
            ]
        },
        "namespaceSelector": {"matchNames": ["a", "b"]},
    }
    (config,) = service_monitor_scrape_configs(monitor(spec), role="endpoints")
    assert config["job_name"] == "serviceMonitor/default/test/0"
    assert config["kubernetes_sd_configs"] == [{"role": "endpoints", "namespaces": {"names": ["a", "b"]}}]
    service = "__meta_kubernetes_service_label"
    assert config["relabel_configs"][1:6] == [
        {
            "action": "keep",
            "source_labels": [f"{service}_alpha", f"{service}present_alpha"],
            "regex": "(beta|gamma);true",
        },
        {
            "action": "drop",
            "source_labels": [
                f"{service}_app_kubernetes_io_tier",
                f"{service}present_app_kubernetes_io_tier",
            ],
            "regex": "(db);true",
        },
        {"action": "keep", "source_labels": [f"{service}present_team"], "regex": "true"},
        {"action": "drop", "source_labels": [f"{service}present_legacy"], "regex": "true"},
        {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": "web"},
    ]
    (anywhere,) = service_monitor_scrape_configs(monitor({"namespaceSelector": {"any": True}}))
    assert anywhere["kubernetes_sd_configs"] == [{"role": "endpointslice"}]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"endpoints": [{"port": "web", "tlsConfig": {}}]}, r"endpoints\[0\]: tlsConfig not translated"),
        ({"sampleLimit": 10}, "sampleLimit not translated"),
        ({"selector": {"matchExpressions": [{"key": "a", "operator": "Gt"}]}}, "'Gt' is not In, NotIn"),
        ({"endpoints": [{"port": "web", "relabelings": [{"action": "keep", "regexp": "x"}]}]}, "regexp not"),
        ({"endpoints": []}, "nothing to scrape"),
        ({"serviceDiscoveryRole": "Pod"}, "'Pod' is not one of"),
    ],
    ids=["endpoint-tls", "sample-limit", "operator", "relabel-typo", "no-endpoints", "role"],
)
def test_what_would_scrape_otherwise_is_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(MonitoringObjectError, match=message) as caught:
        service_monitor_scrape_configs(monitor(spec))
    assert "ServiceMonitor default/test" in str(caught.value)


def test_a_rule_without_groups_is_refused() -> None:
    rule: dict[str, Any] = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "r"},
    }
    with pytest.raises(MonitoringObjectError, match=r"PrometheusRule r: metadata\.namespace"):
        rule_file_content(rule)
    rule["metadata"]["namespace"] = "ns"
    with pytest.raises(MonitoringObjectError, match=r"PrometheusRule ns/r: spec\.groups: empty"):
        rule_file_content({**rule, "spec": {"groups": []}})


def test_the_server_refuses_discovery_with_no_api_server_and_twice_named_jobs() -> None:
    (config,) = service_monitor_scrape_configs(monitor({}))
    with pytest.raises(ValueError, match="name no api_server; pass kubernetes="):
        PrometheusServer(scrape_configs=[config]).config()
    with pytest.raises(ValueError, match="named more than once: serviceMonitor/default/test/0"):
        PrometheusServer(
            scrape_configs=[config, config], kubernetes=Access("https://x", *[Path("/f")] * 3)
        ).config()
    own = {**config, "kubernetes_sd_configs": [{"role": "endpointslice", "api_server": "https://elsewhere"}]}
    (job,) = PrometheusServer(scrape_configs=[own]).config()["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "endpointslice", "api_server": "https://elsewhere"}]
