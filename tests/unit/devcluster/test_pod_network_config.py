"""The pod network's pieces as configured (``cluster_network``, ``config``, ``chart_stack``): the
apiserver advertised on the network's host end and calling webhooks at their endpoints, kube-proxy
told its address and masquerading Service traffic, the chart's values for the NVIDIA runtime class."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from hamipy.devcluster.chart_stack import dev_values
from hamipy.devcluster.cluster_network import NetworkNames
from hamipy.devcluster.config import apiserver_args, kube_proxy_config
from hamipy.devcluster.kubeobjects import open_crd


def test_the_network_names_come_from_the_workdir_and_its_ends_are_the_first_two_addresses(
    tmp_path: Path,
) -> None:
    names = NetworkNames.for_workdir(tmp_path)
    assert names == NetworkNames.for_workdir(tmp_path)
    assert names.netns == names.link == f"hpn-{names.id}"
    assert len(names.link) <= 15  # a Linux interface name
    net = ipaddress.IPv4Network(names.subnet)
    assert net.subnet_of(ipaddress.IPv4Network("10.128.0.0/9"))
    assert (names.host_ip, names.inside_ip) == (str(net[1]), str(net[2]))
    assert NetworkNames.for_workdir(tmp_path / "other").id != names.id


def test_the_apiserver_is_advertised_on_the_pod_network_and_routes_to_endpoints() -> None:
    def args(advertise: str | None = None) -> list[str]:
        return apiserver_args(
            etcd_url="http://127.0.0.1:1",
            secure_port=6443,
            cert_dir="/c",
            service_cluster_ip_range="10.96.0.0/16",
            advertise_address=advertise,
        )

    loopback = args()
    assert "--bind-address=127.0.0.1" in loopback
    assert "--advertise-address=127.0.0.1" in loopback
    assert not [a for a in loopback if a.startswith("--enable-aggregator-routing")]
    network = args("10.200.0.1")
    assert "--advertise-address=10.200.0.1" in network
    assert "--bind-address=0.0.0.0" in network
    assert "--enable-aggregator-routing=true" in network


def test_kube_proxy_is_given_its_address_and_masquerades_service_traffic() -> None:
    config = kube_proxy_config(
        kubeconfig="/k", address="10.200.0.2", healthz="10.200.0.2:1", metrics="10.200.0.2:2", name="node-0"
    )
    assert config["mode"] == "iptables"
    assert config["bindAddress"] == "10.200.0.2"
    assert config["hostnameOverride"] == "node-0"
    assert config["iptables"] == {"masqueradeAll": True}
    # The host's conntrack settings are left as they are.
    assert config["conntrack"] == {
        "maxPerCore": 0,
        "tcpEstablishedTimeout": "0s",
        "tcpCloseWaitTimeout": "0s",
    }


def test_the_dev_values_name_the_nvidia_runtime_class_for_each_service_that_needs_it() -> None:
    assert dev_values() == [
        "--set",
        "devicePlugin.runtimeClassName=nvidia",
        "--set",
        "monitor.runtimeClassName=nvidia",
        "--set",
        "webhook.runtimeClassName=nvidia",
    ]
    assert dev_values(otlp_endpoint="http://10.0.0.1:4318")[-2:] == [
        "--set",
        "tracing.otlpEndpoint=http://10.0.0.1:4318",
    ]


def test_an_open_crd_stores_any_object_of_its_kind() -> None:
    crd = open_crd("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors")
    assert crd["metadata"]["name"] == "servicemonitors.monitoring.coreos.com"
    (version,) = crd["spec"]["versions"]
    assert version["schema"]["openAPIV3Schema"]["x-kubernetes-preserve-unknown-fields"] is True
    assert crd["spec"]["names"]["listKind"] == "ServiceMonitorList"
