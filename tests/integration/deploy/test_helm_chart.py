"""The Helm chart: rendered with the pinned helm for several value sets and
applied to the real test apiserver with server-side dry-run, so every object is valid for this
Kubernetes release; its pieces that must equal what the code and the integration tests use (the
shared config schema, the MutatingWebhookConfiguration, the hami-scheduler's
KubeSchedulerConfiguration, the alerts file) are checked against them; and the operator's values
(ServiceMonitors, the webhook's PodDisruptionBudget, the scheduler's image, name overrides, extra
arguments and environment) are checked where they land."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_values import CHART, KUBE_VERSION, RELEASE, helm_lint, helm_template
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from stack_support import extender_config

from hamipy.devcluster.binaries import KUBERNETES_VERSION
from hamipy.devcluster.config import ExtenderTLS, SchedulerConfig, render_scheduler_config
from hamipy.devcluster.identities import SERVICE_RULES
from hamipy.devcluster.kubeobjects import ensure_crds, open_crd
from hamipy.manifests.admission_policy import admission_policies
from hamipy.protocol import keys
from hamipy.protocol.config import NvidiaConfig, load_config
from hamipy.protocol.resources import ResourceNames
from hamipy.protocol.settings import Declared
from hamipy.serving.tls import serving_context
from hamipy.webhook.registration import webhook_configuration

pytestmark = pytest.mark.integration

API_TIMEOUT_S = 10.0
# values key -> (workload kind, name suffix, container, the container's argument list, metrics port)
SERVICES = {
    "webhook": ("Deployment", "-webhook", "webhook", "args", 9090),
    "extender": ("Deployment", "-extender", "extender", "args", 9396),
    "scheduler": ("Deployment", "-scheduler", "kube-scheduler", "command", None),
    "devicePlugin": ("DaemonSet", "-device-plugin", "device-plugin", "args", 9395),
    "monitor": ("DaemonSet", "-monitor", "monitor", "args", 9394),
}
# The series of these carry the namespace and pod of tenants' pods (see the chart's serviceMonitor).
HONOR_LABELS = {"extender", "monitor"}
EXTRA_ENV = [
    {"name": "HAMIPY_TEST_EXTRA", "value": "1"},
    {"name": "HAMIPY_TEST_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]


def _extra_args(key: str) -> list[str]:
    return [f"--{key.lower()}-extra=1", "--v=4"]


def _extras() -> list[str]:
    args: list[str] = []
    for key in SERVICES:
        args += ["--set-json", f"{key}.extraArgs={json.dumps(_extra_args(key))}"]
        args += ["--set-json", f"{key}.extraEnv={json.dumps(EXTRA_ENV)}"]
    return args


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
    "monitoring": [
        *[a for key in SERVICES if SERVICES[key][4] for a in ("--set", f"{key}.serviceMonitor.enabled=true")],
        "--set",
        "extender.serviceMonitor.labels.release=kube-prometheus-stack",
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "prometheusRule.labels.release=kube-prometheus-stack",
    ],
    "renamed-with-extras": ["--set", "fullnameOverride=gpu-sharing", *_extras()],
}
# The CRDs cert-manager and the Prometheus operator would install: only their kinds, so the
# dry-run can place the chart's Issuer, Certificate, ServiceMonitors and PrometheusRule.
FOREIGN_CRDS = [
    ("cert-manager.io", "v1", "Issuer", "issuers"),
    ("cert-manager.io", "v1", "Certificate", "certificates"),
    ("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors"),
    ("monitoring.coreos.com", "v1", "PrometheusRule", "prometheusrules"),
]


def render(namespace: str, *args: str, kube_version: str = KUBE_VERSION) -> list[dict[str, Any]]:
    proc = helm_template(*args, namespace=namespace, kube_version=kube_version)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


def container(docs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    kind, suffix, name, _, _ = SERVICES[key]
    containers: list[dict[str, Any]] = one(docs, kind, suffix)["spec"]["template"]["spec"]["containers"]
    (found,) = [c for c in containers if c["name"] == name]
    return found


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render("hami-system", *args) for name, args in VALUE_SETS.items()}


# -- the chart against the code -------------------------------------------------------------------


def test_chart_lints_clean() -> None:
    proc = helm_lint()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shared_config_loads_with_the_protocol_schema(rendered: dict[str, list[dict[str, Any]]]) -> None:
    config = load_config(one(rendered["defaults"], "ConfigMap", "-config")["data"]["config.yaml"])
    assert config.nvidia.device_split_count == 10
    assert config.nvidia.hook_path == "/usr/local/vgpu"


def _nvidia(docs: list[dict[str, Any]]) -> NvidiaConfig:
    return load_config(one(docs, "ConfigMap", "-config")["data"]["config.yaml"]).nvidia


def _cdi_mounts(docs: list[dict[str, Any]], key: str) -> list[tuple[str, dict[str, Any]]]:
    """(mount path, host path volume) of what ``key``'s container mounts at the configured CDI
    spec directory."""
    kind, suffix, _, _, _ = SERVICES[key]
    volumes = {v["name"]: v for v in one(docs, kind, suffix)["spec"]["template"]["spec"]["volumes"]}
    return [
        (m["mountPath"], volumes[m["name"]].get("hostPath", {}))
        for m in container(docs, key)["volumeMounts"]
        if m["mountPath"] == _nvidia(docs).cdi_spec_dir
    ]


def test_the_cdi_strategy_mounts_the_hosts_spec_directory_where_the_config_says(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The device plugin writes each slot's spec into the runtime's CDI directory and the monitor
    removes those of pods gone: both see the host's directory at the configured path, read-write.
    Under the default envvar strategy neither mounts it."""
    args = ["config.nvidia.deviceListStrategy=cdi-cri", "config.nvidia.cdiSpecDir=/run/cdi"]
    docs = render("hami-system", *(a for arg in args for a in ("--set", arg)))
    assert (_nvidia(docs).device_list_strategy, _nvidia(docs).cdi_spec_dir) == ("cdi-cri", "/run/cdi")
    assert _nvidia(rendered["defaults"]).device_list_strategy == "envvar"
    for key in ("devicePlugin", "monitor"):
        assert _cdi_mounts(docs, key) == [("/run/cdi", {"path": "/run/cdi", "type": "DirectoryOrCreate"})]
        assert _cdi_mounts(rendered["defaults"], key) == []


def test_only_mig_management_gives_the_device_plugin_the_rights_to_change_mig(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Making and destroying MIG instances takes CAP_SYS_ADMIN and the MIG capability devices; a
    plugin that serves slices or static instances gets neither."""

    def rights(docs: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
        found = container(docs, "devicePlugin")
        env = {e["name"]: e.get("value", "") for e in found["env"] if e["name"].startswith("NVIDIA_MIG_")}
        return found["securityContext"]["capabilities"]["add"], env

    assert rights(rendered["defaults"]) == (["CHOWN", "DAC_OVERRIDE", "FOWNER"], {})
    mig = render("hami-system", "--set", "devicePlugin.migManagement=true")
    assert rights(mig) == (
        ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SYS_ADMIN"],
        {"NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all"},
    )


def test_webhook_configuration_is_the_one_the_webhook_builds(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    chart = one(rendered["defaults"], "MutatingWebhookConfiguration", "-webhook")
    code = webhook_configuration(service_name=f"{RELEASE}-webhook", service_namespace="hami-system")
    assert chart["webhooks"] == code["webhooks"]


def test_admission_policies_are_the_ones_the_code_builds() -> None:
    heads = ["system:serviceaccount:kube-system:hami-scheduler", "system:serviceaccount:kube-system:other"]
    docs = render(
        "hami-system",
        "--set-json",
        f"admissionPolicy.extraSchedulers={json.dumps(heads)}",
        "--set-json",
        'admissionPolicy.extraDevicePlugins=["system:serviceaccount:kube-system:hami-device-plugin"]',
        "--set-json",
        'admissionPolicy.exemptNamespaces=["gpu-operator", "hami-system"]',
        "--set",
        "config.nvidia.resourceCountName=example.com/vgpu",
        "--set",
        "config.nvidia.resourceMemoryPercentageName=example.com/vgpumem-percentage",
        "--set",
        "config.nvidia.hookPath=/opt/hami//vgpu/",
    )
    chart = [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]
    code = admission_policies(
        schedulers=[f"system:serviceaccount:hami-system:{RELEASE}-extender", *heads],
        device_plugins=[
            f"system:serviceaccount:hami-system:{RELEASE}-device-plugin",
            "system:serviceaccount:kube-system:hami-device-plugin",
        ],
        names=ResourceNames(count="example.com/vgpu", memory_percentage="example.com/vgpumem-percentage"),
        # The release namespace always, and once.
        exempt_namespaces=["hami-system", "gpu-operator"],
        # Cleaned, as the container runtime cleans the device plugin's mount paths.
        hook_paths=["/opt/hami/vgpu"],
        prefix=f"{RELEASE}-",
    )
    # helm orders the documents by kind.
    assert sorted(chart, key=json.dumps) == sorted(code, key=json.dumps)
    off = render("hami-system", "--set", "admissionPolicy.enabled=false")
    assert not [d for d in off if d["kind"].startswith("ValidatingAdmissionPolicy")]


@pytest.mark.parametrize("service", sorted(SERVICE_RULES))
def test_make_up_runs_each_service_with_the_charts_rights(
    rendered: dict[str, list[dict[str, Any]]], service: str
) -> None:
    role = one(rendered["defaults"], "ClusterRole", f"{RELEASE}-{service}")
    assert role["rules"] == list(SERVICE_RULES[service])


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
    url = f"https://{RELEASE}-extender.hami-system.svc:8888"
    client = "/etc/hami-py/extender-client"
    tls = ExtenderTLS(
        ca_file=f"{client}/ca.crt",
        cert_file=f"{client}/tls.crt",
        key_file=f"{client}/tls.key",
        server_name=f"{RELEASE}-extender.hami-system.svc",
    )
    extender = dataclasses.replace(extender_config(url), tls=tls)
    tests = render_scheduler_config(SchedulerConfig.hami(extender), kubeconfig="unused")
    assert chart["leaderElection"] == {
        "leaderElect": True,
        "resourceName": "hami-scheduler",
        "resourceNamespace": "hami-system",
    }
    for key in ("clientConnection", "leaderElection"):
        chart.pop(key, None)
        tests.pop(key, None)
    assert chart == tests


def test_only_the_scheduler_and_the_other_replicas_reach_the_extenders_port(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["defaults"]
    policy = one(docs, "NetworkPolicy", "-extender")
    extender = one(docs, "Deployment", "-extender")["spec"]["template"]["metadata"]["labels"]
    scheduler = one(docs, "Deployment", "-scheduler")["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], extender)
    api, metrics = policy["spec"]["ingress"]
    assert api["ports"] == [{"port": 8888, "protocol": "TCP"}]
    scheduler_peer, replica_peer = api["from"]
    assert selects(scheduler_peer["podSelector"]["matchLabels"], scheduler)
    assert not selects(scheduler_peer["podSelector"]["matchLabels"], extender)
    # Followers forward to the leader (docs/extender.md#replicas).
    assert selects(replica_peer["podSelector"]["matchLabels"], extender)
    assert not selects(replica_peer["podSelector"]["matchLabels"], scheduler)
    assert metrics == {"ports": [{"port": 9396, "protocol": "TCP"}]}
    # The extender demands a client certificate from the CA that signed the scheduler's.
    args = container(docs, "extender")["args"]
    assert "--tls-client-ca-file=/etc/hami-py/extender-tls/ca.crt" in args
    # And offers HTTP/2, so kube-scheduler sends every call on one connection.
    assert "--http2" in args
    server = one(docs, "Secret", "-extender-tls")["data"]
    client = one(docs, "Secret", "-extender-client-tls")["data"]
    assert server["ca.crt"] == client["ca.crt"]


def test_the_charts_extender_certificates_are_ecdsa_from_one_ca(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """ECDSA P-256 keys, not Sprig's RSA-2048 default: the extender makes a handshake's signature for
    most of kube-scheduler's calls in a burst (docs/extender.md#tls-handshakes)."""
    docs = rendered["defaults"]
    for suffix, dns in (("-extender-tls", True), ("-extender-client-tls", False)):
        data = {k: base64.b64decode(v) for k, v in one(docs, "Secret", suffix)["data"].items()}
        key = serialization.load_pem_private_key(data["tls.key"], password=None)
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        ca = x509.load_pem_x509_certificate(data["ca.crt"])
        for public in (key.public_key(), cert.public_key(), ca.public_key()):
            assert isinstance(public, ec.EllipticCurvePublicKey), suffix
            assert public.curve.name == "secp256r1", suffix
        assert cert.public_key() == key.public_key(), suffix
        cert.verify_directly_issued_by(ca)
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            names = san.get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            names = []
        assert ("hami-py-extender.hami-system.svc" in names) == dns, (suffix, names)
        for name, pem in data.items():
            (tmp_path / f"{suffix.lstrip('-')}-{name}").write_bytes(pem)
    # The extender serves with the pair as the chart mounts it.
    serving_context(
        tmp_path / "extender-tls-tls.crt",
        tmp_path / "extender-tls-tls.key",
        client_ca=tmp_path / "extender-tls-ca.crt",
    )


def test_extender_tls_can_be_off_or_bring_your_own() -> None:
    off = render(
        "hami-system", "--set", "extender.tls.enabled=false", "--set", "extender.networkPolicy.enabled=false"
    )
    assert not [d for d in off if d["kind"] in ("Secret", "NetworkPolicy")]
    scheduler = yaml.safe_load(one(off, "ConfigMap", "-scheduler")["data"]["config.yaml"])
    assert scheduler["extenders"][0]["urlPrefix"].startswith("http://")
    assert "tlsConfig" not in scheduler["extenders"][0]
    own = render(
        "hami-system",
        "--set",
        "extender.tls.serverSecret=mine",
        "--set",
        "extender.tls.clientSecret=mine-client",
    )
    assert not [d for d in own if d["kind"] == "Secret" and "extender" in d["metadata"]["name"]]
    volumes = one(own, "Deployment", "-scheduler")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "extender-client", "secret": {"secretName": "mine-client"}} in volumes
    proc = helm_template("--set", "extender.tls.serverSecret=mine")
    assert proc.returncode != 0
    assert "give both serverSecret and clientSecret" in proc.stderr


# -- the chart's pass-through against each service's declared settings ---------------------------------
# (kind, container, the service's CLI module, its image's Dockerfile under deploy/docker)
WORKLOADS = [
    ("Deployment", "webhook", "hamipy.webhook.cli", "webhook"),
    ("Job", "certs", "hamipy.webhook.cli", "webhook"),
    ("Deployment", "extender", "hamipy.extender.cli", "extender"),
    ("DaemonSet", "device-plugin", "hamipy.device_plugin.cli", "device-plugin"),
    ("DaemonSet", "monitor", "hamipy.monitor.cli", "monitor"),
]
# Where the chart (or the image) passes a setting a value of the deployment's own, not the service's
# default: paths and ports of the pod, names of the release, the downward API, leader election
# always on. Any other setting the chart passes must be passed its declared default, so the chart's
# values and the code cannot drift apart.
DEPLOYMENT_CHOICES = {
    "webhook": {"config", "metrics-port", "cert-file", "key-file", "scheduler-name"},
    "certs": {"namespace", "service", "secret", "webhook-config"},
    "extender": {
        "config",
        "metrics-port",
        "tls-cert-file",
        "tls-key-file",
        "tls-client-ca-file",
        "leader-elect",
        "own-pod",
        "follower-redirect",
        "cold-standby",
        "lease-namespace",
        "lease-name",
        "identity",
        "advertise-url",
        "peer-server-name",
    },
    "device-plugin": {"config", "node-name", "interposer"},
    "monitor": {"config", "node-name"},
}


def _containers(docs: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    return [
        c
        for d in docs
        if d["kind"] == kind
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] == name
    ]


def _entrypoint_args(image: str) -> list[str]:
    """The arguments the image's ENTRYPOINT gives before the pod's own (JSON form)."""
    text = (Path(__file__).resolve().parents[3] / "deploy" / "docker" / f"{image}.Dockerfile").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("ENTRYPOINT ")]
    return list(json.loads(line.removeprefix("ENTRYPOINT ")))[1:]


def _passed(
    found: dict[str, Any], module: Any, image: str
) -> tuple[list[str], dict[str, str], list[Declared]]:
    """What the chart gives one container: its arguments (the image's first), its environment
    (a downward-API value as a placeholder) and the settings its command takes."""
    args = [*_entrypoint_args(image), *found.get("args", [])]
    env = {e["name"]: e.get("value", f"$({e['name']})") for e in found.get("env", [])}
    if hasattr(module, "COMMANDS"):
        groups = module.COMMANDS[args[0] if args and args[0] in module.COMMANDS else "serve"].settings
    else:
        groups = module.SETTINGS
    return args, env, [item for group in groups for item in group.declared()]


@pytest.mark.parametrize(
    ("values", "kind", "name", "module_name", "image"),
    [
        pytest.param(values, *workload, id=f"{values}-{workload[1]}")
        for values in ("defaults", "cert-manager")
        for workload in WORKLOADS
        if (values, workload[1]) != ("cert-manager", "certs")  # cert-manager makes the certificate there
    ],
)
def test_what_the_chart_passes_a_service_is_a_setting_it_declares_with_its_default(
    rendered: dict[str, list[dict[str, Any]]], kind: str, name: str, module_name: str, image: str, values: str
) -> None:
    import importlib

    (container,) = _containers(rendered[values], kind, name)
    module = importlib.import_module(module_name)
    args, env, settings = _passed(container, module, image)
    by_flag = {item.flag: item for item in settings}
    by_variable = {variable: item for item in settings for variable in item.variables(module.ENV_PREFIX)}
    passed = {
        arg.removeprefix("--").removeprefix("no-").partition("=")[0] for arg in args if arg.startswith("--")
    }
    for flag in passed:
        assert flag in by_flag, f"the chart passes {name} --{flag}, which it does not take"
    for variable in env:
        assert variable in by_variable or not variable.startswith(module.ENV_PREFIX), (
            f"{variable}: no such setting"
        )
    passed |= {by_variable[variable].flag for variable in env if variable in by_variable}

    parsed = module.build_parser(env).parse_args(args)
    for flag in sorted(passed):
        item = by_flag[flag]
        assert item.setting.kind == "user", f"the chart sets --{flag}, a tuning knob of {name}"
        if flag not in DEPLOYMENT_CHOICES[name]:
            value = getattr(parsed, item.dest)
            assert value == item.default, (
                f"the chart passes {name} --{flag}={value!r}, its default is {item.default!r}"
            )
    assert DEPLOYMENT_CHOICES[name] <= passed, "a deployment choice the chart no longer makes"


def test_extender_replicas_are_their_own(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert one(rendered["three-extenders"], "Deployment", "-extender")["spec"]["replicas"] == 3
    assert one(rendered["three-extenders"], "Deployment", "-webhook")["spec"]["replicas"] == 2


def test_kube_scheduler_reaches_the_leading_extender_and_prometheus_every_replica(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Each replica labels its own pod with its role (--own-pod); the scheduler's Service selects the
    leader, the metrics Service every replica."""
    docs = rendered["defaults"]
    deployment = one(docs, "Deployment", "-extender")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    args = container(docs, "extender")["args"]
    namespace = deployment["metadata"]["namespace"]
    assert f"--own-pod={namespace}/$(POD_NAME)" in args
    api = one(docs, "Service", "-extender")
    metrics = one(docs, "Service", "-extender-metrics")
    leader = {**pod_labels, keys.EXTENDER_ROLE: "leader"}
    assert selects(api["spec"]["selector"], leader)
    assert not selects(api["spec"]["selector"], {**pod_labels, keys.EXTENDER_ROLE: "follower"})
    assert [p["port"] for p in api["spec"]["ports"]] == [8888]
    assert selects(metrics["spec"]["selector"], pod_labels)
    assert [p["name"] for p in metrics["spec"]["ports"]] == ["metrics"]


# -- monitoring: ServiceMonitors and the PrometheusRule -------------------------------------------


def test_monitoring_objects_are_off_by_default(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kinds = {d["kind"] for d in rendered["defaults"]}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"}


@pytest.mark.parametrize("key", [k for k in SERVICES if SERVICES[k][4]])
def test_a_service_monitor_scrapes_each_metrics_port(
    rendered: dict[str, list[dict[str, Any]]], key: str
) -> None:
    docs = rendered["monitoring"]
    kind, suffix, _, _, port = SERVICES[key]
    monitor = one(docs, "ServiceMonitor", suffix)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    # Without honorLabels the operator's target labels replace the tenants' namespace and pod.
    assert endpoint["honorLabels"] is (key in HONOR_LABELS)
    # It selects exactly one Service, whose port of that name reaches the container's metrics port.
    (service,) = [
        d
        for d in docs
        if d["kind"] == "Service"
        and selects(monitor["spec"]["selector"]["matchLabels"], d["metadata"]["labels"])
    ]
    (service_port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert service_port["port"] == port
    workload = one(docs, kind, suffix)
    assert selects(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])
    (container_port,) = [p for p in container(docs, key)["ports"] if p["name"] == service_port["targetPort"]]
    assert container_port["containerPort"] == port
    # A DaemonSet's targets are its nodes: headless, and each series says which node.
    node = {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
    assert (service["spec"].get("clusterIP") == "None") is (kind == "DaemonSet")
    assert (node in endpoint.get("relabelings", [])) is (kind == "DaemonSet")
    # The extender's per-container series name the tenant's container by index: the scraped
    # container's own name ("extender") is not attached to them.
    tenant_series = {
        "sourceLabels": ["__name__"],
        "regex": "hami_vgpu_.*",
        "targetLabel": "container",
        "replacement": "",
    }
    assert (tenant_series in endpoint.get("metricRelabelings", [])) is (key == "extender")


def test_service_monitor_labels_and_interval_are_the_values(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["monitoring"]
    extender = one(docs, "ServiceMonitor", "-extender")
    assert extender["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert extender["spec"]["endpoints"][0]["interval"] == "30s"
    assert one(docs, "ServiceMonitor", "-monitor")["spec"]["endpoints"][0]["interval"] == "15s"


def test_prometheus_rule_groups_are_the_alerts_file(rendered: dict[str, list[dict[str, Any]]]) -> None:
    rule = one(rendered["monitoring"], "PrometheusRule", "-alerts")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    # Prometheus's own templates reach it verbatim (never rendered by helm).
    assert "{{ $labels.pod }}" in json.dumps(rule["spec"]["groups"])


# -- the webhook's PodDisruptionBudget -----------------------------------------------------------


def test_webhook_pdb_selects_the_webhook_pods_only(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1
    selector = pdb["spec"]["selector"]["matchLabels"]
    webhook = one(docs, "Deployment", "-webhook")
    assert selector == webhook["spec"]["selector"]["matchLabels"]
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "DaemonSet", "Job")
    }
    assert [name for name, labels in pods.items() if selects(selector, labels)] == [f"{RELEASE}-webhook"]


@pytest.mark.parametrize(
    "args", [["--set", "webhook.replicas=1"], ["--set", "webhook.podDisruptionBudget.enabled=false"]]
)
def test_no_webhook_pdb_with_one_replica_or_disabled(args: list[str]) -> None:
    assert not [d for d in render("hami-system", *args) if d["kind"] == "PodDisruptionBudget"]


# -- the kube-scheduler's image ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kube_version", "args", "image"),
    [
        ("1.31.5", [], "registry.k8s.io/kube-scheduler:v1.31.5"),
        # Managed clusters' versions: only vMAJOR.MINOR.PATCH has an image.
        ("1.30.2-eks-1234", [], "registry.k8s.io/kube-scheduler:v1.30.2"),
        ("1.33.1+k3s1", [], "registry.k8s.io/kube-scheduler:v1.33.1"),
        (
            "1.31.5",
            [
                "--set",
                "scheduler.image.repository=mirror.example.com/kube-scheduler",
                "--set",
                "scheduler.image.tag=v1.31.4",
            ],
            "mirror.example.com/kube-scheduler:v1.31.4",
        ),
        # The chart's first form, a string, still works.
        (
            "1.31.5",
            ["--set", "scheduler.image=mirror.example.com/kube-scheduler:v1.31.3"],
            "mirror.example.com/kube-scheduler:v1.31.3",
        ),
    ],
)
def test_scheduler_image_follows_the_cluster_version(
    rendered: dict[str, list[dict[str, Any]]], kube_version: str, args: list[str], image: str
) -> None:
    docs = render("hami-system", *args, kube_version=kube_version)
    assert container(docs, "scheduler")["image"] == image
    # Only the image follows the version: the scheduler's configuration stays the same.
    config = one(docs, "ConfigMap", "-scheduler")["data"]
    assert config == one(rendered["defaults"], "ConfigMap", "-scheduler")["data"]


# -- names, extra arguments and environment ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "prefix"),
    [
        ([], f"{RELEASE}-"),
        (["--set", "nameOverride=gpu"], f"{RELEASE}-gpu-"),
        (["--set", "fullnameOverride=gpu-sharing"], "gpu-sharing-"),
        (
            ["--set", "fullnameOverride=gpu-sharing", "--set", "webhook.certificates.mode=certManager"],
            "gpu-sharing-",
        ),
    ],
)
def test_name_overrides_name_every_object_and_keep_references(args: list[str], prefix: str) -> None:
    docs = render("hami-system", *args)
    for doc in docs:
        assert doc["metadata"]["name"].startswith(prefix), doc["metadata"]["name"]
    webhook = f"{prefix}webhook"
    service = one(docs, "Service", "-webhook")
    assert service["metadata"]["name"] == webhook
    mwc = one(docs, "MutatingWebhookConfiguration", "-webhook")
    assert mwc["metadata"]["name"] == webhook
    assert mwc["webhooks"][0]["clientConfig"]["service"]["name"] == webhook
    pod = one(docs, "Deployment", "-webhook")["spec"]["template"]["spec"]
    (secret,) = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
    certificates = [d for d in docs if d["kind"] == "Certificate"]
    if certificates:
        (certificate,) = certificates
        assert certificate["spec"]["secretName"] == secret
        assert certificate["spec"]["dnsNames"] == [
            f"{webhook}.hami-system.svc",
            f"{webhook}.hami-system.svc.cluster.local",
        ]
        annotation = mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        assert annotation == f"hami-system/{certificate['metadata']['name']}"
    else:
        (job,) = [d for d in docs if d["kind"] == "Job"]
        certs = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert {
            "--namespace=hami-system",
            f"--service={webhook}",
            f"--secret={secret}",
            f"--webhook-config={webhook}",
        } <= set(certs)
    # The scheduler calls the extender's Service; every pod runs as a ServiceAccount of the chart.
    scheduler = yaml.safe_load(one(docs, "ConfigMap", "-scheduler")["data"]["config.yaml"])
    extender = one(docs, "Service", "-extender")["metadata"]["name"]
    assert scheduler["extenders"][0]["urlPrefix"] == f"https://{extender}.hami-system.svc:8888"
    # kube-scheduler's client certificate and the extender's serving one are the chart's Secrets.
    pod = one(docs, "Deployment", "-extender")["spec"]["template"]["spec"]
    (tls_secret,) = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
    pod = one(docs, "Deployment", "-scheduler")["spec"]["template"]["spec"]
    (client_secret,) = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert {tls_secret, client_secret} <= secrets
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    for doc in docs:
        if doc["kind"] in ("Deployment", "DaemonSet", "Job"):
            assert doc["spec"]["template"]["spec"]["serviceAccountName"] in accounts


def _unnamed(args: list[str]) -> list[str]:
    """Arguments without the values that carry an object's name (renamed in one render)."""
    return [a for a in args if not a.startswith(("--lease-name=", "--peer-server-name="))]


@pytest.mark.parametrize("key", sorted(SERVICES))
def test_extra_args_and_env_land_in_each_service(rendered: dict[str, list[dict[str, Any]]], key: str) -> None:
    plain = container(rendered["defaults"], key)
    extra = container(rendered["renamed-with-extras"], key)
    field = SERVICES[key][3]
    assert _unnamed(extra[field]) == _unnamed(plain.get(field, [])) + _extra_args(key)
    assert extra["env"] == plain.get("env", []) + EXTRA_ENV


def test_the_certificate_job_takes_none_of_the_webhooks_extras(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    # `hamipy-webhook certs` is another command than `serve`: the webhook's flags are not its own.
    (job,) = [d for d in rendered["renamed-with-extras"] if d["kind"] == "Job"]
    (certs,) = job["spec"]["template"]["spec"]["containers"]
    assert not set(_extra_args("webhook")) & set(certs["args"])
    assert "env" not in certs


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
    await ensure_crds(api, [open_crd(*crd) for crd in FOREIGN_CRDS])


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
