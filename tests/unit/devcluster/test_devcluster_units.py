"""Pure parts of hamipy.devcluster: scheduler config, kubeconfig, certificates, node bodies, waits."""

from __future__ import annotations

import base64
import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import hamipy.devcluster as devcluster
from hamipy.devcluster import (
    ExtenderConfig,
    ExtenderTLS,
    ManagedResource,
    NodeSpec,
    SchedulerConfig,
    SchedulerLeaderElection,
    WaitTimeout,
    wait_for,
)
from hamipy.devcluster.binaries import _staging_modules, version_matches
from hamipy.devcluster.cli import build_parser
from hamipy.devcluster.config import apiserver_args, render_kubeconfig, render_scheduler_config
from hamipy.devcluster.pki import make_cluster_pki

EXTENDER = ExtenderConfig(
    url_prefix="https://127.0.0.1:9443/scheduler",
    filter_verb="filter",
    bind_verb="bind",
    prioritize_verb="score",
    weight=3,
    node_cache_capable=True,
    managed_resources=(ManagedResource("nvidia.com/gpu"), ManagedResource("nvidia.com/gpumem", False)),
    http_timeout_s=1.5,
    tls=ExtenderTLS(ca_file="/tmp/ca.crt", server_name="extender"),
)


class TestSchedulerConfig:
    def test_hami_profile_with_extender(self) -> None:
        doc = render_scheduler_config(
            SchedulerConfig.hami(EXTENDER, percentage_of_nodes_to_score=50), kubeconfig="/k"
        )
        assert doc["apiVersion"] == "kubescheduler.config.k8s.io/v1"
        assert doc["kind"] == "KubeSchedulerConfiguration"
        assert doc["profiles"] == [{"schedulerName": "hami-scheduler"}]
        assert doc["leaderElection"] == {"leaderElect": False}
        assert doc["clientConnection"]["kubeconfig"] == "/k"
        assert doc["percentageOfNodesToScore"] == 50
        assert doc["extenders"] == [
            {
                "urlPrefix": "https://127.0.0.1:9443/scheduler",
                "filterVerb": "filter",
                "prioritizeVerb": "score",
                "bindVerb": "bind",
                "weight": 3,
                "enableHTTPS": True,
                "tlsConfig": {"insecure": False, "caFile": "/tmp/ca.crt", "serverName": "extender"},
                "httpTimeout": "1.5s",
                "nodeCacheCapable": True,
                "managedResources": [
                    {"name": "nvidia.com/gpu", "ignoredByScheduler": True},
                    {"name": "nvidia.com/gpumem", "ignoredByScheduler": False},
                ],
                "ignorable": False,
            }
        ]

    def test_unused_verbs_and_weight_are_left_out(self) -> None:
        doc = render_scheduler_config(
            SchedulerConfig.hami(ExtenderConfig(url_prefix="http://x:1")), kubeconfig="/k"
        )
        ext = doc["extenders"][0]
        assert ext["filterVerb"] == "filter"
        assert not {"bindVerb", "prioritizeVerb", "preemptVerb", "weight", "tlsConfig"} & set(ext)
        assert ext["enableHTTPS"] is False
        assert "percentageOfNodesToScore" not in doc

    def test_leader_election_renders_the_lease_and_its_times(self) -> None:
        election = SchedulerLeaderElection(
            "ns", "hami", lease_duration_s=6, renew_deadline_s=4, retry_period_s=0.5
        )
        doc = render_scheduler_config(
            SchedulerConfig.hami(EXTENDER, leader_election=election), kubeconfig="/k"
        )
        assert doc["leaderElection"] == {
            "leaderElect": True,
            "resourceLock": "leases",
            "resourceNamespace": "ns",
            "resourceName": "hami",
            "leaseDuration": "6s",
            "renewDeadline": "4s",
            "retryPeriod": "0.5s",
        }

    @pytest.mark.parametrize(("lease", "renew", "retry"), [(4, 4, 1), (6, 4, 3.5), (6, 4, 0)])
    def test_leader_election_refuses_times_kube_scheduler_would_refuse(
        self, lease: float, renew: float, retry: float
    ) -> None:
        election = SchedulerLeaderElection(
            "ns", lease_duration_s=lease, renew_deadline_s=renew, retry_period_s=retry
        )
        with pytest.raises(ValueError, match="lease_duration_s > renew_deadline_s"):
            render_scheduler_config(SchedulerConfig.hami(EXTENDER, leader_election=election), kubeconfig="/k")

    def test_default_profile_has_no_extenders(self) -> None:
        doc = render_scheduler_config(SchedulerConfig(), kubeconfig="/k")
        assert doc["profiles"] == [{"schedulerName": "default-scheduler"}]
        assert "extenders" not in doc

    def test_ignored_resources_go_to_each_profiles_fit_plugin(self) -> None:
        config = SchedulerConfig(profiles=("a", "b"), ignored_resources=("example.com/x",))
        doc = render_scheduler_config(config, kubeconfig="/k")
        fit = {"name": "NodeResourcesFit", "args": {"ignoredResources": ["example.com/x"]}}
        assert doc["profiles"] == [
            {"schedulerName": "a", "pluginConfig": [fit]},
            {"schedulerName": "b", "pluginConfig": [fit]},
        ]

    @pytest.mark.parametrize(
        ("config", "message"),
        [
            pytest.param(SchedulerConfig(profiles=()), "at least one", id="no-profiles"),
            pytest.param(SchedulerConfig(profiles=("a", "a")), "duplicate", id="duplicate-profile"),
            pytest.param(
                SchedulerConfig(percentage_of_nodes_to_score=101), "0..100", id="percentage-too-big"
            ),
        ],
    )
    def test_bad_config_is_refused(self, config: SchedulerConfig, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            render_scheduler_config(config, kubeconfig="/k")


PKI = make_cluster_pki(service_ip="10.96.0.1")


def _cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


class TestCertificates:
    def test_serving_cert_names_loopback_service_ip_and_service_dns(self) -> None:
        san = _cert(PKI.apiserver_serving.cert_pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        )
        ips = set(san.value.get_values_for_type(x509.IPAddress))
        dns = set(san.value.get_values_for_type(x509.DNSName))
        assert ips == {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.96.0.1")}
        assert {"localhost", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"} <= dns

    @pytest.mark.parametrize(
        ("pair", "usage"),
        [
            pytest.param(PKI.apiserver_serving, ExtendedKeyUsageOID.SERVER_AUTH, id="serving"),
            pytest.param(PKI.admin_client, ExtendedKeyUsageOID.CLIENT_AUTH, id="admin"),
            pytest.param(PKI.scheduler_client, ExtendedKeyUsageOID.CLIENT_AUTH, id="scheduler"),
        ],
    )
    def test_leaves_are_signed_by_the_ca_for_their_use(
        self, pair: object, usage: x509.ObjectIdentifier
    ) -> None:
        cert = _cert(pair.cert_pem)  # type: ignore[attr-defined]
        cert.verify_directly_issued_by(_cert(PKI.ca.cert_pem))
        assert usage in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert cert.not_valid_before_utc <= datetime.datetime.now(datetime.UTC) <= cert.not_valid_after_utc

    def test_admin_is_in_system_masters(self) -> None:
        subject = _cert(PKI.admin_client.cert_pem).subject
        assert [a.value for a in subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)] == [
            "system:masters"
        ]

    def test_scheduler_is_the_bootstrap_scheduler_user(self) -> None:
        subject = _cert(PKI.scheduler_client.cert_pem).subject
        assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:kube-scheduler"

    def test_ca_is_a_ca(self) -> None:
        constraints = _cert(PKI.ca.cert_pem).extensions.get_extension_for_class(x509.BasicConstraints).value
        assert constraints.ca is True


def test_kubeconfig_embeds_ca_and_client_cert() -> None:
    doc = render_kubeconfig(
        server="https://127.0.0.1:6443",
        ca_pem=PKI.ca.cert_pem,
        client_cert_pem=PKI.admin_client.cert_pem,
        client_key_pem=PKI.admin_client.key_pem,
    )
    cluster = doc["clusters"][0]["cluster"]
    user = doc["users"][0]["user"]
    assert cluster["server"] == "https://127.0.0.1:6443"
    assert base64.b64decode(cluster["certificate-authority-data"]) == PKI.ca.cert_pem
    assert base64.b64decode(user["client-certificate-data"]) == PKI.admin_client.cert_pem
    assert base64.b64decode(user["client-key-data"]) == PKI.admin_client.key_pem
    assert doc["current-context"] == doc["contexts"][0]["name"]


def test_apiserver_is_loopback_tls_only_with_node_and_rbac() -> None:
    args = apiserver_args(
        etcd_url="http://127.0.0.1:2379",
        secure_port=6443,
        cert_dir="/c",
        service_cluster_ip_range="10.96.0.0/16",
    )
    assert "--bind-address=127.0.0.1" in args
    assert "--authorization-mode=Node,RBAC" in args
    assert "--client-ca-file=/c/ca.crt" in args
    assert not [a for a in args if "insecure" in a]


class TestNodeSpec:
    def test_body_has_standard_and_chosen_labels(self) -> None:
        body = NodeSpec(name="n1", labels={"gpu": "on"}, annotations={"a": "b"}).node_body()
        labels = body["metadata"]["labels"]
        assert labels["kubernetes.io/hostname"] == "n1"
        assert labels["gpu"] == "on"
        assert labels["hami-py.io/simulated-node"] == "true"
        assert body["metadata"]["annotations"] == {"a": "b"}

    def test_status_is_ready_with_merged_capacity(self) -> None:
        spec = NodeSpec(name="n1", capacity={"nvidia.com/gpu": "4"}, allocatable={"cpu": "15"})
        status = spec.status_body(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))["status"]
        assert status["capacity"]["nvidia.com/gpu"] == "4"
        assert status["capacity"]["pods"] == "110"
        assert status["allocatable"]["cpu"] == "15"
        assert status["allocatable"]["nvidia.com/gpu"] == "4"
        ready = [c for c in status["conditions"] if c["type"] == "Ready"]
        assert ready[0]["status"] == "True"
        assert ready[0]["lastHeartbeatTime"] == "2026-01-01T00:00:00Z"


class TestWaitFor:
    async def test_returns_the_first_truthy_value(self) -> None:
        values = iter([0, None, "", "done"])
        assert await wait_for(lambda: next(values), timeout=5, interval=0.001) == "done"

    async def test_awaits_async_predicates(self) -> None:
        async def ready() -> int:
            return 7

        assert await wait_for(ready, timeout=5) == 7

    async def test_timeout_names_what_and_the_last_error(self) -> None:
        def broken() -> bool:
            raise KeyError("pod-x")

        with pytest.raises(WaitTimeout, match=r"waiting for the pod.*KeyError\('pod-x'\)"):
            await wait_for(broken, timeout=0.05, interval=0.01, what="the pod")


def test_public_api_is_complete_and_importable() -> None:
    assert set(devcluster.__all__) == set(devcluster._EXPORTS)
    for name in devcluster.__all__:
        assert getattr(devcluster, name) is not None


def test_version_matches_reads_the_release(tmp_path: Path) -> None:
    fake = tmp_path / "kube-apiserver"
    fake.write_text("#!/bin/sh\necho 'Kubernetes v1.34.4'\n")
    fake.chmod(0o755)
    assert version_matches(fake, "v1.34.4")
    assert not version_matches(fake, "v1.34.40")
    assert not version_matches(fake, "v1.34")
    assert not version_matches(tmp_path / "missing", "v1.34.4")


def test_staging_modules_come_from_replace_lines() -> None:
    gomod = (
        "replace (\n"
        "\tk8s.io/api => ./staging/src/k8s.io/api\n"
        "\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n"
        ")\n"
    )
    assert _staging_modules(gomod) == ["k8s.io/api", "k8s.io/client-go"]


def test_cli_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("binaries", "up", "down", "status"):
        assert command in out
