"""The cluster DNS objects (hamipy.devcluster.cluster_dns): the ``kube-dns`` Service at the given IP
on port 53, CoreDNS with only the read rights its ``kubernetes`` plugin needs, a Corefile that
forwards nowhere, and probes on the ports the Corefile serves."""

from __future__ import annotations

import re
from typing import Any

import pytest

from hamipy.devcluster import cluster_dns
from hamipy.devcluster.cluster_dns import DNS_CONTAINER_PORT, corefile, manifests, object_path

CLUSTER_IP = "10.96.0.10"
IMAGE = "hamipy.local/coredns:v1.14.7"


def by_kind() -> dict[str, Any]:
    return {manifest["kind"]: manifest for manifest in manifests(cluster_ip=CLUSTER_IP, image=IMAGE)}


def container() -> Any:
    return by_kind()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def directives(text: str) -> list[str]:
    """The first word of each Corefile line."""
    return [line.split()[0] for line in text.splitlines() if line.strip() and line.split()[0] != "}"]


def test_the_service_is_kube_dns_at_the_given_ip_on_port_53_over_udp_and_tcp() -> None:
    service = by_kind()["Service"]
    assert (service["metadata"]["namespace"], service["metadata"]["name"]) == ("kube-system", "kube-dns")
    assert service["spec"]["clusterIP"] == CLUSTER_IP
    ports = {(port["protocol"], port["port"], port["targetPort"]) for port in service["spec"]["ports"]}
    assert ports == {("UDP", 53, DNS_CONTAINER_PORT), ("TCP", 53, DNS_CONTAINER_PORT)}


def test_the_service_reaches_the_dns_pods_on_the_port_they_listen_on() -> None:
    objects = by_kind()
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert objects["Service"]["spec"]["selector"].items() <= labels.items()
    served = {(port["protocol"], port["containerPort"]) for port in container()["ports"]}
    assert served == {("UDP", DNS_CONTAINER_PORT), ("TCP", DNS_CONTAINER_PORT)}
    assert re.search(rf"^\.:{DNS_CONTAINER_PORT} {{", corefile(), re.MULTILINE)
    assert DNS_CONTAINER_PORT > 1023  # bound without NET_BIND_SERVICE by a user other than root


def test_coredns_may_only_list_and_watch_what_its_kubernetes_plugin_reads() -> None:
    objects = by_kind()
    granted = {
        (group, resource, verb)
        for rule in objects["ClusterRole"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        (group, resource, verb)
        for group, resource in (
            ("discovery.k8s.io", "endpointslices"),
            ("", "services"),
            ("", "pods"),
            ("", "namespaces"),
        )
        for verb in ("list", "watch")
    }


def test_the_binding_gives_the_role_to_the_deployments_service_account() -> None:
    objects = by_kind()
    binding, account = objects["ClusterRoleBinding"], objects["ServiceAccount"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": objects["ClusterRole"]["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "kube-system"}
    ]
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_the_corefile_forwards_nowhere_and_serves_the_cluster_zones() -> None:
    text = corefile()
    assert "forward" not in directives(text)
    assert directives(text) == [
        f".:{DNS_CONTAINER_PORT}",
        "errors",
        "health",
        "ready",
        "kubernetes",
        "pods",
        "fallthrough",
        "ttl",
        "cache",
        "loop",
        "reload",
    ]
    assert "    kubernetes cluster.local in-addr.arpa ip6.arpa {\n" in text
    assert "        pods insecure\n" in text
    assert "        fallthrough in-addr.arpa ip6.arpa\n" in text
    assert "    cache 30\n" in text


def test_the_deployment_reads_the_corefile_of_the_configmap() -> None:
    objects = by_kind()
    assert objects["ConfigMap"]["data"] == {"Corefile": corefile()}
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    (mount,) = container()["volumeMounts"]
    assert mount["name"] == volume["name"]
    (item,) = volume["configMap"]["items"]
    assert container()["args"] == ["-conf", f"{mount['mountPath']}/{item['path']}"]


def test_the_probes_ask_the_ports_the_corefile_serves_health_and_readiness_on() -> None:
    text = corefile()
    ready, live = container()["readinessProbe"]["httpGet"], container()["livenessProbe"]["httpGet"]
    assert (ready["path"], ready["port"]) == ("/ready", 8181)
    assert (live["path"], live["port"]) == ("/health", 8080)
    assert "    ready :8181\n" in text
    assert "    health :8080\n" in text


def test_one_critical_pod_on_any_node_resolving_through_its_node() -> None:
    deployment = by_kind()["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 1
    assert (
        deployment["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert pod["dnsPolicy"] == "Default"
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert container()["image"] == IMAGE
    assert container()["securityContext"]["runAsNonRoot"] is True
    assert container()["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_objects_are_applied_at_their_api_paths() -> None:
    paths = [object_path(manifest) for manifest in manifests(cluster_ip=CLUSTER_IP, image=IMAGE)]
    assert paths == [
        "/api/v1/namespaces/kube-system/serviceaccounts/coredns",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/system:coredns",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/system:coredns",
        "/api/v1/namespaces/kube-system/configmaps/coredns",
        "/api/v1/namespaces/kube-system/services/kube-dns",
        "/apis/apps/v1/namespaces/kube-system/deployments/coredns",
    ]


@pytest.mark.parametrize("cluster_ip", ["", "10.96.0", "kube-dns", "10.96.0.10/32"])
def test_a_cluster_ip_that_is_not_an_address_is_refused_by_name(cluster_ip: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(cluster_ip))):
        manifests(cluster_ip=cluster_ip, image=IMAGE)


def test_an_empty_image_is_refused() -> None:
    with pytest.raises(ValueError, match="image"):
        manifests(cluster_ip=CLUSTER_IP, image="")


def test_the_kubelets_cluster_domain_is_the_one_coredns_serves() -> None:
    assert cluster_dns.DNS_CLUSTER_DOMAIN == "cluster.local"
    assert f"    kubernetes {cluster_dns.DNS_CLUSTER_DOMAIN} " in corefile()
