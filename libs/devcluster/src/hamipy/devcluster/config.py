"""Typed settings for the kube-scheduler and the kubeconfig files, rendered to plain dicts.

Pure: no files, no processes. `cluster` dumps what these functions return as YAML. The scheduler
config follows ``kubescheduler.config.k8s.io/v1`` and the extender fields follow its ``Extender``
type (k8s.io/kube-scheduler/config/v1), which is also what HAMi's own scheduler config uses.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from typing import Any, Final

DEFAULT_SCHEDULER_NAME = "default-scheduler"
HAMI_SCHEDULER_NAME = "hami-scheduler"


@dataclasses.dataclass(frozen=True)
class ManagedResource:
    """An extended resource the extender owns.

    With `ignored_by_scheduler` kube-scheduler's own fit check skips it (the extender decides).
    """

    name: str
    ignored_by_scheduler: bool = True


@dataclasses.dataclass(frozen=True)
class ExtenderTLS:
    """TLS settings kube-scheduler uses to reach an HTTPS extender (paths are on this machine)."""

    insecure: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""


@dataclasses.dataclass(frozen=True)
class ExtenderConfig:
    """One scheduler extender: where it is and which verbs and resources it handles.

    Empty verbs are left out (kube-scheduler then does not call that verb).
    """

    url_prefix: str
    filter_verb: str = "filter"
    bind_verb: str = ""
    prioritize_verb: str = ""
    preempt_verb: str = ""
    # Weight of the prioritize scores; kube-scheduler requires > 0 when prioritize_verb is set.
    weight: int = 1
    # True: kube-scheduler sends NodeNames only and expects the extender to keep its own node cache.
    node_cache_capable: bool = True
    managed_resources: tuple[ManagedResource, ...] = ()
    # Seconds kube-scheduler waits for each extender call before treating it as failed.
    http_timeout_s: float = 30.0
    # True: a failing/unreachable extender is skipped instead of failing the pod's scheduling.
    ignorable: bool = False
    tls: ExtenderTLS | None = None

    @property
    def enable_https(self) -> bool:
        return self.url_prefix.startswith("https://")


@dataclasses.dataclass(frozen=True)
class SchedulerLeaderElection:
    """kube-scheduler's own leader election by a Lease ``namespace/name``: several processes with the
    same profile, one scheduling at a time (as a highly available control plane runs it). Times in
    seconds; kube-scheduler requires lease > renew deadline > 1.2 x retry period. The name is the
    one the ``system:kube-scheduler`` ClusterRole may get and update; any namespace keeps tests apart."""

    namespace: str
    name: str = "kube-scheduler"
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def render(self) -> dict[str, Any]:
        if not self.lease_duration_s > self.renew_deadline_s > 1.2 * self.retry_period_s > 0:
            raise ValueError(
                "SchedulerLeaderElection: need lease_duration_s > renew_deadline_s > 1.2 x retry_period_s "
                f"> 0 (got {self.lease_duration_s:g}, {self.renew_deadline_s:g}, {self.retry_period_s:g})"
            )
        return {
            "leaderElect": True,
            "resourceLock": "leases",
            "resourceNamespace": self.namespace,
            "resourceName": self.name,
            "leaseDuration": _duration(self.lease_duration_s),
            "renewDeadline": _duration(self.renew_deadline_s),
            "retryPeriod": _duration(self.retry_period_s),
        }


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What one kube-scheduler process runs: its profiles (by schedulerName) and its extenders.

    Extenders in KubeSchedulerConfiguration are global to the process, not per profile, which is
    why the devcluster runs the ``default-scheduler`` and ``hami-scheduler`` as two processes
    (exactly as a real cluster with HAMi does).
    """

    profiles: tuple[str, ...] = (DEFAULT_SCHEDULER_NAME,)
    extenders: tuple[ExtenderConfig, ...] = ()
    # None: kube-scheduler's adaptive default. 100 makes small test clusters fully deterministic.
    percentage_of_nodes_to_score: int | None = None
    # None: this process schedules alone (no election).
    leader_election: SchedulerLeaderElection | None = None
    # Extended resources NodeResourcesFit leaves to others in every profile (its ``ignoredResources``):
    # what an extender's ``managedResources`` with ``ignoredByScheduler`` does, without the extender.
    ignored_resources: tuple[str, ...] = ()

    @classmethod
    def hami(
        cls,
        extender: ExtenderConfig,
        *,
        percentage_of_nodes_to_score: int | None = None,
        leader_election: SchedulerLeaderElection | None = None,
    ) -> SchedulerConfig:
        """The `hami-scheduler` profile with one extender, as HAMi deploys it."""
        return cls(
            profiles=(HAMI_SCHEDULER_NAME,),
            extenders=(extender,),
            percentage_of_nodes_to_score=percentage_of_nodes_to_score,
            leader_election=leader_election,
        )


def _duration(seconds: float) -> str:
    """A Go duration string (``30s``, ``1.5s``) as metav1.Duration parses it."""
    return f"{seconds:g}s"


def render_extender(ext: ExtenderConfig) -> dict[str, Any]:
    """One entry of KubeSchedulerConfiguration ``extenders``."""
    out: dict[str, Any] = {"urlPrefix": ext.url_prefix}
    for key, verb in (
        ("filterVerb", ext.filter_verb),
        ("prioritizeVerb", ext.prioritize_verb),
        ("preemptVerb", ext.preempt_verb),
        ("bindVerb", ext.bind_verb),
    ):
        if verb:
            out[key] = verb
    if ext.prioritize_verb:
        out["weight"] = ext.weight
    out["enableHTTPS"] = ext.enable_https
    if ext.tls is not None:
        tls: dict[str, Any] = {"insecure": ext.tls.insecure}
        for key, value in (
            ("caFile", ext.tls.ca_file),
            ("certFile", ext.tls.cert_file),
            ("keyFile", ext.tls.key_file),
            ("serverName", ext.tls.server_name),
        ):
            if value:
                tls[key] = value
        out["tlsConfig"] = tls
    out["httpTimeout"] = _duration(ext.http_timeout_s)
    out["nodeCacheCapable"] = ext.node_cache_capable
    if ext.managed_resources:
        out["managedResources"] = [
            {"name": r.name, "ignoredByScheduler": r.ignored_by_scheduler} for r in ext.managed_resources
        ]
    out["ignorable"] = ext.ignorable
    return out


def _profile(name: str, ignored: tuple[str, ...]) -> dict[str, Any]:
    profile: dict[str, Any] = {"schedulerName": name}
    if ignored:
        fit_args = {"ignoredResources": list(ignored)}
        profile["pluginConfig"] = [{"name": "NodeResourcesFit", "args": fit_args}]
    return profile


def render_scheduler_config(config: SchedulerConfig, *, kubeconfig: str) -> dict[str, Any]:
    """A KubeSchedulerConfiguration (v1) for one kube-scheduler process; leader election off unless
    ``config.leader_election`` says otherwise."""
    if not config.profiles:
        raise ValueError("SchedulerConfig.profiles: at least one schedulerName is needed")
    if len(set(config.profiles)) != len(config.profiles):
        raise ValueError(f"SchedulerConfig.profiles: duplicate schedulerName in {config.profiles!r}")
    pct = config.percentage_of_nodes_to_score
    if pct is not None and not 0 <= pct <= 100:
        raise ValueError(f"SchedulerConfig.percentage_of_nodes_to_score: must be 0..100 (got {pct})")
    doc: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig, "qps": 500, "burst": 1000},
        "leaderElection": (
            config.leader_election.render() if config.leader_election else {"leaderElect": False}
        ),
        "profiles": [_profile(name, config.ignored_resources) for name in config.profiles],
    }
    if pct is not None:
        doc["percentageOfNodesToScore"] = pct
    if config.extenders:
        doc["extenders"] = [render_extender(e) for e in config.extenders]
    return doc


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def render_kubeconfig(
    *,
    server: str,
    ca_pem: bytes,
    client_cert_pem: bytes,
    client_key_pem: bytes,
    user: str = "admin",
    cluster: str = "hamipy-devcluster",
) -> dict[str, Any]:
    """A self-contained kubeconfig (certificates embedded) for client-certificate authentication."""
    context = f"{user}@{cluster}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": cluster, "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)}}
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client_cert_pem),
                    "client-key-data": _b64(client_key_pem),
                },
            }
        ],
        "contexts": [{"name": context, "context": {"cluster": cluster, "user": user}}],
        "current-context": context,
        "preferences": {},
    }


def apiserver_args(
    *,
    etcd_url: str,
    secure_port: int,
    cert_dir: str,
    service_cluster_ip_range: str,
    advertise_address: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """kube-apiserver flags: loopback TLS only, client certs + SA tokens, Node,RBAC authorization.

    `cert_dir` must hold the files `cluster` writes: ca.crt, apiserver.crt/.key, sa.key/.pub,
    kubelet-client.crt/.key (what it shows kubelets for logs and exec; kubelets serve on loopback).
    ``advertise_address``: a pod network's host address (``cluster_network``), the kubernetes
    Service's endpoint; the apiserver then listens on every address and calls webhooks and
    aggregated APIs at their endpoints (the host has no Service rules: kube-proxy's are the pod
    network's).
    """
    network = (
        [
            "--bind-address=0.0.0.0",
            f"--advertise-address={advertise_address}",
            "--enable-aggregator-routing=true",
        ]
        if advertise_address
        else ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"]
    )
    return [
        f"--etcd-servers={etcd_url}",
        *network,
        f"--secure-port={secure_port}",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={cert_dir}/apiserver.crt",
        f"--tls-private-key-file={cert_dir}/apiserver.key",
        f"--client-ca-file={cert_dir}/ca.crt",
        f"--service-account-key-file={cert_dir}/sa.pub",
        f"--service-account-signing-key-file={cert_dir}/sa.key",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--authorization-mode=Node,RBAC",
        f"--kubelet-client-certificate={cert_dir}/kubelet-client.crt",
        f"--kubelet-client-key={cert_dir}/kubelet-client.key",
        "--kubelet-preferred-address-types=InternalIP",
        f"--service-cluster-ip-range={service_cluster_ip_range}",
        "--allow-privileged=true",
        "--profiling=false",
        *extra,
    ]


def kube_proxy_config(
    *, kubeconfig: str, address: str, healthz: str, metrics: str, name: str
) -> dict[str, Any]:
    """kube-proxy's configuration in a pod network (``cluster_network``): iptables mode, every
    Service connection masqueraded (pods on one bridge then answer a Service's client through the
    namespace, bridge netfilter or not), and the host's conntrack sysctls left alone."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig},
        "hostnameOverride": name,
        # Its address given, it does not wait for a Node of its name to learn it.
        "bindAddress": address,
        "nodePortAddresses": ["primary"],
        "mode": "iptables",
        "clusterCIDR": "10.128.0.0/9",
        "iptables": {"masqueradeAll": True},
        "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "healthzBindAddress": healthz,
        "metricsBindAddress": metrics,
    }


CONTROLLERS: Final = ("*", "-nodelifecycle", "-podgc")
"""Every default controller but two that would undo the simulated nodes: the node lifecycle
controller taints a node unreachable and evicts its pods once its Lease is 40 s old, and the
benchmarks' thousands of simulated nodes renew theirs only every 5 minutes (as would a node whose
heartbeat a test stops); the pod garbage collector deletes pods bound to node names that do not
exist, which some tests use on purpose."""


def controller_manager_args(*, kubeconfig: str, secure_port: int, cert_dir: str, pki_dir: str) -> list[str]:
    """kube-controller-manager flags: loopback only, each controller with its own ServiceAccount's
    credentials (as kubeadm runs it), the ServiceAccount token signer and the root CA to publish.

    `pki_dir` must hold the files `cluster` writes: ca.crt and sa.key.
    """
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={secure_port}",
        f"--cert-dir={cert_dir}",
        f"--root-ca-file={pki_dir}/ca.crt",
        f"--service-account-private-key-file={pki_dir}/sa.key",
        "--use-service-account-credentials=true",
        f"--controllers={','.join(CONTROLLERS)}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]
