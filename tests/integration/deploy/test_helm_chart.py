"""The Helm chart (issue 10): rendered with the pinned helm for several value sets and applied to
the real test apiserver with server-side dry-run, so every object is valid for this Kubernetes
release; and its pieces that must equal what the code and the integration tests use (the shared
config schema, the MutatingWebhookConfiguration, the hami-scheduler's KubeSchedulerConfiguration)
are checked against them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from stack_support import extender_config

from hamipy.devcluster.binaries import KUBERNETES_VERSION, ensure_helm
from hamipy.devcluster.config import SchedulerConfig, render_scheduler_config
from hamipy.protocol.config import load_config
from hamipy.webhook.registration import webhook_configuration

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "deploy" / "helm" / "hami-py"
RELEASE = "hami-py"
API_TIMEOUT_S = 10.0
VALUE_SETS = {
    "defaults": [],
    "three-extenders": ["--set", "extender.replicas=3"],
    "cert-manager": [
        "--set",
        "webhook.certificates.mode=certManager",
        "--set",
        "monitor.serviceMonitor.enabled=true",
        "--set",
        "tracing.otlpEndpoint=http://otel-collector.observability:4318",
    ],
}
# The CRDs cert-manager and the Prometheus operator would install: only their kinds, so the
# dry-run can place the chart's Issuer, Certificate and ServiceMonitor.
FOREIGN_CRDS = [
    ("cert-manager.io", "v1", "Issuer", "issuers"),
    ("cert-manager.io", "v1", "Certificate", "certificates"),
    ("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors"),
]


def render(namespace: str, *args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [
            str(ensure_helm()),
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            namespace,
            "--kube-version",
            KUBERNETES_VERSION.lstrip("v"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render("hami-system", *args) for name, args in VALUE_SETS.items()}


# -- the chart against the code -------------------------------------------------------------------


def test_chart_lints_clean() -> None:
    proc = subprocess.run(
        [
            str(ensure_helm()),
            "lint",
            str(CHART),
            "--strict",
            "--kube-version",
            KUBERNETES_VERSION.lstrip("v"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shared_config_loads_with_the_protocol_schema(rendered: dict[str, list[dict[str, Any]]]) -> None:
    config = load_config(one(rendered["defaults"], "ConfigMap", "-config")["data"]["config.yaml"])
    assert config.nvidia.device_split_count == 10
    assert config.nvidia.hook_path == "/usr/local/vgpu"


def test_webhook_configuration_is_the_one_the_webhook_builds(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    chart = one(rendered["defaults"], "MutatingWebhookConfiguration", "-webhook")
    code = webhook_configuration(service_name=f"{RELEASE}-webhook", service_namespace="hami-system")
    assert chart["webhooks"] == code["webhooks"]


def test_cert_manager_mode_injects_the_ca(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cert-manager"]
    chart = one(docs, "MutatingWebhookConfiguration", "-webhook")
    assert (
        chart["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"hami-system/{RELEASE}-webhook"
    )
    assert one(docs, "Certificate", "-webhook")["spec"]["secretName"] == f"{RELEASE}-webhook-tls"
    assert not [d for d in docs if d["kind"] == "Job"], "no certs Job with cert-manager"


def test_scheduler_config_is_the_one_the_integration_tests_run(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    chart = yaml.safe_load(one(rendered["defaults"], "ConfigMap", "-scheduler")["data"]["config.yaml"])
    url = f"http://{RELEASE}-extender.hami-system.svc:8888"
    tests = render_scheduler_config(SchedulerConfig.hami(extender_config(url)), kubeconfig="unused")
    assert chart["leaderElection"] == {
        "leaderElect": True,
        "resourceName": "hami-scheduler",
        "resourceNamespace": "hami-system",
    }
    for key in ("clientConnection", "leaderElection"):
        chart.pop(key, None)
        tests.pop(key, None)
    assert chart == tests


def test_extender_replicas_are_their_own(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert one(rendered["three-extenders"], "Deployment", "-extender")["spec"]["replicas"] == 3
    assert one(rendered["three-extenders"], "Deployment", "-webhook")["spec"]["replicas"] == 2


# -- the chart against the real apiserver --------------------------------------------------------


async def _discover(api: Any) -> dict[tuple[str, str], tuple[str, bool]]:
    """(apiVersion, kind) -> (resource, namespaced), from the apiserver's discovery documents."""
    from kubernetes_asyncio.client import ApisApi

    versions = ["v1"]
    groups = await ApisApi(api).get_api_versions(_request_timeout=API_TIMEOUT_S)
    versions += [v.group_version for g in groups.groups for v in g.versions]
    found: dict[tuple[str, str], tuple[str, bool]] = {}
    for gv in versions:
        path = "/api/v1" if gv == "v1" else f"/apis/{gv}"
        listing = await _call(api, "GET", path)
        for resource in listing["resources"]:
            if "/" not in resource["name"]:
                found[(gv, resource["kind"])] = (resource["name"], resource["namespaced"])
    return found


async def _call(api: Any, method: str, path: str, body: Any = None, **query: str) -> Any:
    resp = await api.call_api(
        path,
        method,
        query_params=list(query.items()),
        header_params={
            "Accept": "application/json",
            "Content-Type": "application/apply-patch+yaml" if method == "PATCH" else "application/json",
        },
        body=body,
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=API_TIMEOUT_S,
    )
    try:
        data = await resp.read()
    finally:
        resp.release()
    assert resp.status < 300, f"{method} {path}: HTTP {resp.status}: {data[:2000]!r}"
    return json.loads(data)


async def _ensure_foreign_crds(api: Any) -> None:
    from kubernetes_asyncio.client import ApiextensionsV1Api
    from kubernetes_asyncio.client.exceptions import ApiException

    from hamipy.devcluster import wait_for

    ext = ApiextensionsV1Api(api)
    for group, version, kind, plural in FOREIGN_CRDS:
        body = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {
                "group": group,
                "scope": "Namespaced",
                "names": {
                    "kind": kind,
                    "plural": plural,
                    "singular": kind.lower(),
                    "listKind": f"{kind}List",
                },
                "versions": [
                    {
                        "name": version,
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            }
                        },
                    }
                ],
            },
        }
        try:
            await ext.create_custom_resource_definition(body, _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != 409:
                raise

        async def established(name: str = f"{plural}.{group}") -> bool:
            crd = await ext.read_custom_resource_definition(name, _request_timeout=API_TIMEOUT_S)
            return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

        await wait_for(established, timeout=30, interval=0.2, what=f"CRD {plural}.{group} established")


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
async def test_every_object_applies_to_the_real_apiserver(
    kube_client: Any, namespace: str, values: str
) -> None:
    await _ensure_foreign_crds(kube_client)
    docs = render(namespace, *VALUE_SETS[values])
    resources = await _discover(kube_client)
    kinds = set()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        assert key in resources, f"{key} is not served by Kubernetes {KUBERNETES_VERSION}"
        resource, namespaced = resources[key]
        base = "/api/v1" if doc["apiVersion"] == "v1" else f"/apis/{doc['apiVersion']}"
        name = doc["metadata"]["name"]
        if namespaced:
            assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']} {name} has no namespace"
            path = f"{base}/namespaces/{namespace}/{resource}/{name}"
        else:
            path = f"{base}/{resource}/{name}"
        applied = await _call(
            kube_client,
            "PATCH",
            path,
            doc,
            dryRun="All",
            fieldManager="hamipy-chart-test",
            force="true",
        )
        assert applied["kind"] == doc["kind"]
        kinds.add(doc["kind"])
    assert {"Deployment", "DaemonSet", "MutatingWebhookConfiguration", "ClusterRole"} <= kinds


@pytest.mark.parametrize(
    ("component", "prefix", "module"),
    [
        ("-device-plugin", "HAMIPY_DEVICE_PLUGIN_", "hamipy.device_plugin.cli"),
        ("-monitor", "HAMIPY_MONITOR_", "hamipy.monitor.cli"),
    ],
)
def test_every_service_variable_the_chart_sets_is_one_the_service_reads(
    rendered: dict[str, list[dict[str, Any]]], component: str, prefix: str, module: str
) -> None:
    import importlib

    daemonset = one(rendered["defaults"], "DaemonSet", component)
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    variables = {e["name"]: e.get("value") for e in container["env"] if e["name"].startswith(prefix)}
    assert variables
    parser = importlib.import_module(module).build_parser(variables)
    options = {o for action in parser._actions for o in action.option_strings}
    for name, value in variables.items():
        flag = "--" + name.removeprefix(prefix).lower().replace("_", "-")
        assert flag in options, f"{name} names no flag of {module}"
        dest = flag[2:].replace("-", "_")
        parsed = getattr(parser.parse_args(["--node-name", "n"]), dest)
        wanted = value.lower() == "true" if isinstance(parsed, bool) else type(parsed)(value)
        assert parsed == wanted, f"{name}={value} read as {parsed!r}"
