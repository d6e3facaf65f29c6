"""What the Prometheus operator makes of a chart's monitoring objects, done without the operator:
the scrape jobs of its ServiceMonitors and the rule files of its PrometheusRules, so that a plain
Prometheus (`hamipy.devcluster.prometheus.PrometheusServer`) scrapes and alerts as it would under
the operator. The objects are dicts, as ``helm template`` renders them.

`scrape_configs` follows the operator's generated configuration (``generateServiceMonitorConfig``
in its ``pkg/prometheus/promcfg.go``): one job per endpoint of a ServiceMonitor, named
``serviceMonitor/<namespace>/<name>/<index>``, on Kubernetes service discovery (role
``endpointslice`` or ``endpoints``) in the namespaceSelector's namespaces (by default the
ServiceMonitor's own). Its relabelings keep the endpoints of the Services the selector matches, on
the endpoint's port name, and give each target the operator's labels (``namespace``, ``service``,
``pod``, ``container``, ``node`` for node targets, ``job`` as the Service's name, ``endpoint`` as
the port's); the endpoint's own ``relabelings`` come last. The operator's sharding relabelings are
left out: one Prometheus is one shard. The kubernetes_sd_configs name no API server (in a cluster
Prometheus finds its own); `PrometheusServer` adds the dev cluster's.

A field the translation does not know raises `MonitoringObjectError` naming the object and the
field: read as absent, it would have Prometheus scrape otherwise than the operator would.

`rule_file_content` is the operator's rule file for a PrometheusRule: its ``spec`` (the groups),
which `write_rule_files` writes as ``<namespace>-<name>.yaml``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

import yaml

from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.kubeobjects import open_crd

__all__ = [
    "MonitoringObjectError",
    "SDRole",
    "job_name",
    "rule_file_content",
    "scrape_configs",
    "service_monitor_scrape_configs",
    "write_rule_files",
]

SDRole = Literal["endpointslice", "endpoints"]
_ROLES: Final[Mapping[str, SDRole]] = {"EndpointSlice": "endpointslice", "Endpoints": "endpoints"}
_GROUP: Final = "monitoring.coreos.com/v1"

_SPEC_FIELDS: Final = frozenset(
    {
        "selector",
        "namespaceSelector",
        "endpoints",
        "jobLabel",
        "targetLabels",
        "podTargetLabels",
        "serviceDiscoveryRole",
    }
)
_ENDPOINT_FIELDS: Final = frozenset(
    {
        "port",
        "path",
        "scheme",
        "interval",
        "scrapeTimeout",
        "params",
        "honorLabels",
        "honorTimestamps",
        "filterRunning",
        "relabelings",
        "metricRelabelings",
    }
)
# The CRD's RelabelConfig fields and Prometheus's names for them, in the operator's order.
_RELABEL_FIELDS: Final = (
    ("sourceLabels", "source_labels"),
    ("separator", "separator"),
    ("targetLabel", "target_label"),
    ("regex", "regex"),
    ("modulus", "modulus"),
    ("replacement", "replacement"),
    ("action", "action"),
)
_INVALID_LABEL_CHAR: Final = re.compile(r"[^a-zA-Z0-9_]")


class MonitoringObjectError(DevClusterError, ValueError):
    """A ServiceMonitor or PrometheusRule this module cannot translate as the operator would; the
    message names the object and the field."""


def _label(name: str) -> str:
    """A Kubernetes label key as Prometheus meta label suffix (``app.kubernetes.io/name`` ->
    ``app_kubernetes_io_name``), as the operator sanitizes it."""
    return _INVALID_LABEL_CHAR.sub("_", name)


def _service_label(key: str) -> list[str]:
    return [
        f"__meta_kubernetes_service_label_{_label(key)}",
        f"__meta_kubernetes_service_labelpresent_{_label(key)}",
    ]


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise MonitoringObjectError(f"{where}: expected a mapping, got {value!r}")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise MonitoringObjectError(f"{where}: expected a list, got {value!r}")
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise MonitoringObjectError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _strings(value: object, where: str) -> list[str]:
    return [_str(v, f"{where}[{i}]") for i, v in enumerate(_list(value, where))]


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise MonitoringObjectError(f"{where}: expected true or false, got {value!r}")
    return value


def _known(obj: Mapping[str, Any], fields: frozenset[str], where: str) -> None:
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise MonitoringObjectError(
            f"{where}: {', '.join(unknown)} not translated (known: {', '.join(sorted(fields))})"
        )


def job_name(namespace: str, name: str, index: int) -> str:
    """The operator's job name for a ServiceMonitor's `index`-th endpoint."""
    return f"serviceMonitor/{namespace}/{name}/{index}"


def _relabel_configs(value: object, where: str) -> list[dict[str, Any]]:
    """The CRD's RelabelConfigs as Prometheus's relabel_configs (the action lower-cased, as the
    operator writes it; an explicit empty ``replacement`` kept, it differs from the default ``$1``)."""
    configs = []
    for i, raw in enumerate(_list(value, where)):
        here = f"{where}[{i}]"
        step = _mapping(raw, here)
        _known(step, frozenset(crd for crd, _ in _RELABEL_FIELDS), here)
        config: dict[str, Any] = {}
        for crd, prometheus in _RELABEL_FIELDS:
            if crd not in step:
                continue
            field = step[crd]
            if crd == "sourceLabels":
                config[prometheus] = _strings(field, f"{here}.{crd}")
            elif crd == "modulus":
                if not isinstance(field, int) or isinstance(field, bool) or field <= 0:
                    raise MonitoringObjectError(f"{here}.modulus: expected a positive integer, got {field!r}")
                config[prometheus] = field
            elif crd == "action":
                config[prometheus] = _str(field, f"{here}.action").lower()
            elif isinstance(field, str):
                config[prometheus] = field
            else:
                raise MonitoringObjectError(f"{here}.{crd}: expected a string, got {field!r}")
        configs.append(config)
    return configs


def _selector_relabelings(selector: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """Keep the targets of the Services `selector` matches, as the operator's ``relabel`` selector
    mechanism does (matchLabels sorted by key, then matchExpressions in order)."""
    _known(selector, frozenset({"matchLabels", "matchExpressions"}), where)
    steps: list[dict[str, Any]] = []
    labels = _mapping(selector.get("matchLabels") or {}, f"{where}.matchLabels")
    for key in sorted(labels):
        value = labels[key]
        if not isinstance(value, str):
            raise MonitoringObjectError(f"{where}.matchLabels.{key}: expected a string, got {value!r}")
        steps.append({"action": "keep", "source_labels": _service_label(key), "regex": f"({value});true"})
    for i, raw in enumerate(_list(selector.get("matchExpressions") or [], f"{where}.matchExpressions")):
        here = f"{where}.matchExpressions[{i}]"
        expression = _mapping(raw, here)
        _known(expression, frozenset({"key", "operator", "values"}), here)
        key, operator = _str(expression.get("key"), f"{here}.key"), expression.get("operator")
        if operator in ("In", "NotIn"):
            values = _strings(expression.get("values"), f"{here}.values")
            if not values:
                raise MonitoringObjectError(f"{here}.values: {operator} needs at least one value")
            steps.append(
                {
                    "action": "keep" if operator == "In" else "drop",
                    "source_labels": _service_label(key),
                    "regex": f"({'|'.join(values)});true",
                }
            )
        elif operator in ("Exists", "DoesNotExist"):
            if expression.get("values"):
                raise MonitoringObjectError(f"{here}.values: {operator} takes no values")
            steps.append(
                {
                    "action": "keep" if operator == "Exists" else "drop",
                    "source_labels": _service_label(key)[1:],
                    "regex": "true",
                }
            )
        else:
            raise MonitoringObjectError(
                f"{here}.operator: {operator!r} is not In, NotIn, Exists or DoesNotExist"
            )
    return steps


def _namespaces(spec: Mapping[str, Any], own: str, where: str) -> list[str]:
    """The namespaces to discover in: none named for ``any: true`` (all of them), else
    ``matchNames``, else the ServiceMonitor's own."""
    selector = _mapping(spec.get("namespaceSelector") or {}, f"{where}.namespaceSelector")
    _known(selector, frozenset({"any", "matchNames"}), f"{where}.namespaceSelector")
    if _bool(selector.get("any", False), f"{where}.namespaceSelector.any"):
        return []
    names = _strings(selector.get("matchNames") or [], f"{where}.namespaceSelector.matchNames")
    return names or [own]


def _target_labels(spec: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """The Service's (``targetLabels``) and the pod's (``podTargetLabels``) labels copied onto the
    targets that have them."""
    steps = []
    for field, meta in (("targetLabels", "service"), ("podTargetLabels", "pod")):
        for key in _strings(spec.get(field) or [], f"{where}.{field}"):
            steps.append(
                {
                    "source_labels": [f"__meta_kubernetes_{meta}_label_{_label(key)}"],
                    "target_label": _label(key),
                    "regex": "(.+)",
                    "replacement": "${1}",
                }
            )
    return steps


def _endpoint_config(
    monitor: Mapping[str, Any],
    endpoint: Mapping[str, Any],
    index: int,
    *,
    role: SDRole,
) -> dict[str, Any]:
    meta, spec = monitor["metadata"], monitor["spec"]
    namespace, name = meta["namespace"], meta["name"]
    where = f"ServiceMonitor {namespace}/{name}: spec.endpoints[{index}]"
    _known(endpoint, _ENDPOINT_FIELDS, where)

    sd: dict[str, Any] = {"role": role}
    namespaces = _namespaces(spec, namespace, f"ServiceMonitor {namespace}/{name}: spec")
    if namespaces:
        sd["namespaces"] = {"names": namespaces}
    config: dict[str, Any] = {
        "job_name": job_name(namespace, name, index),
        "honor_labels": _bool(endpoint.get("honorLabels", False), f"{where}.honorLabels"),
    }
    if "honorTimestamps" in endpoint:
        config["honor_timestamps"] = _bool(endpoint["honorTimestamps"], f"{where}.honorTimestamps")
    config["kubernetes_sd_configs"] = [sd]
    for field, key in (
        ("interval", "scrape_interval"),
        ("scrapeTimeout", "scrape_timeout"),
        ("path", "metrics_path"),
        ("scheme", "scheme"),
    ):
        if field in endpoint:
            config[key] = _str(endpoint[field], f"{where}.{field}")
    if "params" in endpoint:
        params = _mapping(endpoint["params"], f"{where}.params")
        config["params"] = {k: _strings(v, f"{where}.params.{k}") for k, v in params.items()}

    # The job's own name, kept for the user's relabelings (the operator's first step).
    steps: list[dict[str, Any]] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    steps += _selector_relabelings(
        _mapping(spec.get("selector") or {}, f"ServiceMonitor {namespace}/{name}: spec.selector"),
        f"ServiceMonitor {namespace}/{name}: spec.selector",
    )
    prefix = "__meta_kubernetes_endpointslice" if role == "endpointslice" else "__meta_kubernetes_endpoint"
    port = _str(endpoint["port"], f"{where}.port") if "port" in endpoint else None
    if port is not None:
        steps.append({"action": "keep", "source_labels": [f"{prefix}_port_name"], "regex": port})
    # The endpoint's target: a Node names the target's node, a Pod its pod.
    target = (f"{prefix}_address_target_kind", f"{prefix}_address_target_name")
    steps += [
        {
            "source_labels": list(target),
            "separator": ";",
            "regex": "Node;(.*)",
            "replacement": "${1}",
            "target_label": "node",
        },
        {
            "source_labels": list(target),
            "separator": ";",
            "regex": "Pod;(.*)",
            "replacement": "${1}",
            "target_label": "pod",
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
    ]
    if _bool(endpoint.get("filterRunning", True), f"{where}.filterRunning"):
        steps.append(
            {
                "action": "drop",
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
            }
        )
    steps += _target_labels(spec, f"ServiceMonitor {namespace}/{name}: spec")
    steps.append(
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"}
    )
    if "jobLabel" in spec:
        job_label = _str(spec["jobLabel"], f"ServiceMonitor {namespace}/{name}: spec.jobLabel")
        steps.append(
            {
                "source_labels": [f"__meta_kubernetes_service_label_{_label(job_label)}"],
                "target_label": "job",
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    if port is not None:
        steps.append({"target_label": "endpoint", "replacement": port})
    steps += _relabel_configs(endpoint.get("relabelings") or [], f"{where}.relabelings")
    config["relabel_configs"] = steps

    metric_steps = _relabel_configs(endpoint.get("metricRelabelings") or [], f"{where}.metricRelabelings")
    if metric_steps:
        config["metric_relabel_configs"] = metric_steps
    return config


def service_monitor_scrape_configs(
    monitor: Mapping[str, Any], *, role: SDRole = "endpointslice"
) -> list[dict[str, Any]]:
    """The scrape configs of one ServiceMonitor: one per endpoint, in order. `role` is the service
    discovery role where the ServiceMonitor does not set ``serviceDiscoveryRole``."""
    kind = f"{monitor.get('apiVersion')}/{monitor.get('kind')}"
    if kind != f"{_GROUP}/ServiceMonitor":
        raise MonitoringObjectError(f"not a {_GROUP} ServiceMonitor: {kind}")
    meta = _mapping(monitor.get("metadata"), "ServiceMonitor: metadata")
    name = _str(meta.get("name"), "ServiceMonitor: metadata.name")
    namespace = _str(meta.get("namespace"), f"ServiceMonitor {name}: metadata.namespace")
    where = f"ServiceMonitor {namespace}/{name}: spec"
    spec = _mapping(monitor.get("spec"), where)
    _known(spec, _SPEC_FIELDS, where)
    if "serviceDiscoveryRole" in spec:
        chosen = spec["serviceDiscoveryRole"]
        if chosen not in _ROLES:
            raise MonitoringObjectError(
                f"{where}.serviceDiscoveryRole: {chosen!r} is not one of {sorted(_ROLES)}"
            )
        role = _ROLES[chosen]
    endpoints = _list(spec.get("endpoints"), f"{where}.endpoints")
    if not endpoints:
        raise MonitoringObjectError(f"{where}.endpoints: empty, nothing to scrape")
    return [
        _endpoint_config(monitor, _mapping(ep, f"{where}.endpoints[{i}]"), i, role=role)
        for i, ep in enumerate(endpoints)
    ]


def scrape_configs(
    documents: Iterable[Mapping[str, Any]], *, role: SDRole = "endpointslice"
) -> list[dict[str, Any]]:
    """The scrape configs of every ServiceMonitor among `documents` (other kinds are skipped), in
    their order."""
    return [
        config
        for doc in documents
        if doc.get("kind") == "ServiceMonitor"
        for config in service_monitor_scrape_configs(doc, role=role)
    ]


def _rule_name(rule: Mapping[str, Any]) -> tuple[str, str]:
    kind = f"{rule.get('apiVersion')}/{rule.get('kind')}"
    if kind != f"{_GROUP}/PrometheusRule":
        raise MonitoringObjectError(f"not a {_GROUP} PrometheusRule: {kind}")
    meta = _mapping(rule.get("metadata"), "PrometheusRule: metadata")
    name = _str(meta.get("name"), "PrometheusRule: metadata.name")
    return _str(meta.get("namespace"), f"PrometheusRule {name}: metadata.namespace"), name


def rule_file_content(rule: Mapping[str, Any]) -> dict[str, Any]:
    """The rule file the operator writes for a PrometheusRule: its spec, the rule groups."""
    namespace, name = _rule_name(rule)
    where = f"PrometheusRule {namespace}/{name}: spec"
    spec = _mapping(rule.get("spec"), where)
    _known(spec, frozenset({"groups"}), where)
    groups = _list(spec.get("groups"), f"{where}.groups")
    if not groups:
        raise MonitoringObjectError(f"{where}.groups: empty")
    return {"groups": groups}


def write_rule_files(documents: Iterable[Mapping[str, Any]], directory: Path) -> list[Path]:
    """Write the rule file of every PrometheusRule among `documents` into `directory`, named
    ``<namespace>-<name>.yaml`` as the operator names them (less the UID a rendered object lacks)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for doc in documents:
        if doc.get("kind") != "PrometheusRule":
            continue
        content = rule_file_content(doc)
        namespace, name = _rule_name(doc)
        path = directory / f"{namespace}-{name}.yaml"
        path.write_text(yaml.safe_dump(content, sort_keys=False))
        paths.append(path)
    return paths


OPERATOR_KINDS: Final = (("ServiceMonitor", "servicemonitors"), ("PrometheusRule", "prometheusrules"))
"""The operator's kinds the chart creates, with their plurals."""


def operator_crds() -> list[dict[str, Any]]:
    """CustomResourceDefinitions of ``OPERATOR_KINDS`` with their schema left open (``open_crd``):
    where the operator is not installed, the API server stores what the chart creates, for
    ``scrape_configs`` and ``write_rule_files`` to read back as the operator would."""
    group, version = _GROUP.split("/")
    return [open_crd(group, version, kind, plural) for kind, plural in OPERATOR_KINDS]
