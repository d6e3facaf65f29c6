"""The devcluster's own certificate authority and the keys the control plane needs.

The keys and certificates are made in memory by ``hamipy.kube.certs`` and returned as PEM bytes,
so the logic stays testable without files; `cluster` writes them to its temp directory. Here is
only what a devcluster asks for: which certificates, for whom, and for how long.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Final

from hamipy.kube.certs import KeyPair, issue_cert, make_ca, new_key_pem, public_key_pem

__all__ = ["APISERVER_DNS_NAMES", "CA_NAME", "CERT_VALIDITY", "ClusterPKI", "make_cluster_pki"]

CERT_VALIDITY: Final = datetime.timedelta(days=1)
"""One day is plenty for a test run or a `make up` session and keeps stale certs useless."""
CA_NAME: Final = "hamipy-devcluster-ca"

APISERVER_DNS_NAMES: Final = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
"""The names the apiserver is reached by: loopback for us, the in-cluster service names for pods
(and for webhooks configured by service); its IPs are loopback and the first service IP (the
`kubernetes` Service)."""


@dataclasses.dataclass(frozen=True)
class ClusterPKI:
    """All the key material one devcluster uses."""

    ca: KeyPair
    apiserver_serving: KeyPair
    admin_client: KeyPair
    scheduler_client: KeyPair
    controller_manager_client: KeyPair
    kubelet_client: KeyPair
    """The apiserver's identity to kubelets (logs, exec, port-forward)."""
    service_account_key_pem: bytes
    service_account_pub_pem: bytes


def make_cluster_pki(*, service_ip: str, extra_ips: tuple[str, ...] = ()) -> ClusterPKI:
    """A fresh CA with the apiserver serving cert, the admin, scheduler and controller-manager client
    certs, and SA keys."""
    ca = make_ca(CA_NAME, validity=CERT_VALIDITY)
    serving = issue_cert(
        ca,
        common_name="kube-apiserver",
        validity=CERT_VALIDITY,
        dns_names=APISERVER_DNS_NAMES,
        ip_addresses=("127.0.0.1", service_ip, *extra_ips),
        server=True,
    )
    admin = issue_cert(
        ca,
        common_name="hamipy-admin",
        validity=CERT_VALIDITY,
        organizations=("system:masters",),
        client=True,
    )
    scheduler = issue_cert(ca, common_name="system:kube-scheduler", validity=CERT_VALIDITY, client=True)
    controller_manager = issue_cert(
        ca, common_name="system:kube-controller-manager", validity=CERT_VALIDITY, client=True
    )
    kubelet_client = issue_cert(
        ca,
        common_name="kube-apiserver-kubelet-client",
        validity=CERT_VALIDITY,
        client=True,
    )
    sa_key = new_key_pem()
    return ClusterPKI(
        ca=ca,
        apiserver_serving=serving,
        admin_client=admin,
        scheduler_client=scheduler,
        controller_manager_client=controller_manager,
        kubelet_client=kubelet_client,
        service_account_key_pem=sa_key,
        service_account_pub_pem=public_key_pem(sa_key),
    )
