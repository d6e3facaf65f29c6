"""The dev cluster's DNS: CoreDNS in kube-system behind the ``kube-dns`` Service, as in a real cluster.

Pods on the real-runtime nodes find Services by name (``<service>.<namespace>.svc.cluster.local``)
through the nameserver their kubelet writes into their ``resolv.conf``: the ClusterIP given to
``ensure_cluster_dns``, which kube-proxy forwards to the CoreDNS pod. CoreDNS answers from the API
server (its ``kubernetes`` plugin, with the rights of ``DNS_RULES``) and from nothing else: no
upstream resolver is reachable from here, so the Corefile has no ``forward`` and a name outside the
cluster fails at once (SERVFAIL: no plugin answers it) rather than waiting on a resolver that never
answers. CoreDNS runs as a user other than root (``images.COREDNS_USER``), so it listens on
``DNS_CONTAINER_PORT`` and the Service maps port 53 to it.

The objects are applied server-side (field manager ``FIELD_MANAGER``), so applying them again is a
no-op and a changed Corefile or image is rolled out. The image is ``images.ensure_coredns_image``'s,
imported into each node's containerd.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Final, Literal, NotRequired, TypedDict

from hamipy.kube.client import RawKube

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

__all__ = [
    "DNS_CLUSTER_DOMAIN",
    "DNS_CONTAINER_PORT",
    "DNS_NAMESPACE",
    "DNS_RULES",
    "DNS_SERVICE",
    "FIELD_MANAGER",
    "Manifest",
    "corefile",
    "deployment",
    "ensure_cluster_dns",
    "manifests",
    "object_path",
    "service",
]

DNS_CLUSTER_DOMAIN: Final = "cluster.local"
"""The kubelet's ``clusterDomain``: pods search ``<namespace>.svc.cluster.local`` and its parents."""
DNS_NAMESPACE: Final = "kube-system"
DNS_SERVICE: Final = "kube-dns"
"""The Service's name in every Kubernetes distribution, whatever server answers behind it."""
NAME: Final = "coredns"
"""The ServiceAccount, ClusterRole, ClusterRoleBinding, ConfigMap and Deployment."""
LABELS: Final = {"k8s-app": DNS_SERVICE}
"""Upstream's selector of the DNS pods."""
DNS_PORT: Final = 53
DNS_CONTAINER_PORT: Final = 1053
"""Above 1024: a process that is not root binds it without NET_BIND_SERVICE."""
HEALTH_PORT: Final = 8080
READY_PORT: Final = 8181
CONFIG_DIR: Final = "/etc/coredns"
FIELD_MANAGER: Final = "hamipy-devcluster"
APPLY_PATCH: Final = "application/apply-patch+yaml"
"""Server-side apply's content type (JSON is YAML)."""


class PolicyRule(TypedDict):
    apiGroups: list[str]
    resources: list[str]
    verbs: list[str]


DNS_RULES: Final[tuple[PolicyRule, ...]] = (
    {"apiGroups": [""], "resources": ["services", "pods", "namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
)
"""What CoreDNS's ``kubernetes`` plugin reads (it watches; it never gets or writes)."""


class Metadata(TypedDict):
    name: str
    namespace: NotRequired[str]
    labels: NotRequired[dict[str, str]]


class ServiceAccount(TypedDict):
    apiVersion: Literal["v1"]
    kind: Literal["ServiceAccount"]
    metadata: Metadata


class ClusterRole(TypedDict):
    apiVersion: Literal["rbac.authorization.k8s.io/v1"]
    kind: Literal["ClusterRole"]
    metadata: Metadata
    rules: list[PolicyRule]


class RoleRef(TypedDict):
    apiGroup: str
    kind: str
    name: str


class Subject(TypedDict):
    kind: str
    name: str
    namespace: str


class ClusterRoleBinding(TypedDict):
    apiVersion: Literal["rbac.authorization.k8s.io/v1"]
    kind: Literal["ClusterRoleBinding"]
    metadata: Metadata
    roleRef: RoleRef
    subjects: list[Subject]


class ConfigMap(TypedDict):
    apiVersion: Literal["v1"]
    kind: Literal["ConfigMap"]
    metadata: Metadata
    data: dict[str, str]


IPProtocol = Literal["UDP", "TCP"]


class ServicePort(TypedDict):
    name: str
    port: int
    protocol: IPProtocol
    targetPort: int


class ServiceSpec(TypedDict):
    clusterIP: str
    selector: dict[str, str]
    ports: list[ServicePort]


class Service(TypedDict):
    apiVersion: Literal["v1"]
    kind: Literal["Service"]
    metadata: Metadata
    spec: ServiceSpec


class HTTPGet(TypedDict):
    path: str
    port: int
    scheme: Literal["HTTP"]


class Probe(TypedDict):
    httpGet: HTTPGet
    initialDelaySeconds: int
    periodSeconds: int
    timeoutSeconds: int
    failureThreshold: int


class ContainerPort(TypedDict):
    name: str
    containerPort: int
    protocol: IPProtocol


class Capabilities(TypedDict):
    drop: list[str]


class SecurityContext(TypedDict):
    allowPrivilegeEscalation: bool
    readOnlyRootFilesystem: bool
    runAsNonRoot: bool
    capabilities: Capabilities


class VolumeMount(TypedDict):
    name: str
    mountPath: str
    readOnly: bool


class Container(TypedDict):
    name: str
    image: str
    imagePullPolicy: Literal["IfNotPresent"]
    args: list[str]
    ports: list[ContainerPort]
    resources: dict[str, dict[str, str]]
    readinessProbe: Probe
    livenessProbe: Probe
    securityContext: SecurityContext
    volumeMounts: list[VolumeMount]


class Toleration(TypedDict):
    operator: Literal["Exists"]


class KeyToPath(TypedDict):
    key: str
    path: str


class ConfigMapVolumeSource(TypedDict):
    name: str
    items: list[KeyToPath]


class Volume(TypedDict):
    name: str
    configMap: ConfigMapVolumeSource


class PodSpec(TypedDict):
    serviceAccountName: str
    priorityClassName: str
    dnsPolicy: Literal["Default"]
    tolerations: list[Toleration]
    nodeSelector: dict[str, str]
    containers: list[Container]
    volumes: list[Volume]


class PodTemplate(TypedDict):
    metadata: dict[str, dict[str, str]]
    spec: PodSpec


class LabelSelector(TypedDict):
    matchLabels: dict[str, str]


class DeploymentSpec(TypedDict):
    replicas: int
    selector: LabelSelector
    template: PodTemplate


class Deployment(TypedDict):
    apiVersion: Literal["apps/v1"]
    kind: Literal["Deployment"]
    metadata: Metadata
    spec: DeploymentSpec


Manifest = ServiceAccount | ClusterRole | ClusterRoleBinding | ConfigMap | Service | Deployment

_COLLECTIONS: Final[dict[str, tuple[str, str]]] = {
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles"),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings"),
}
"""Kind -> (its group-version's path, its resource)."""


def corefile(*, domain: str = DNS_CLUSTER_DOMAIN, port: int = DNS_CONTAINER_PORT) -> str:
    """CoreDNS's configuration: the cluster's zone and the reverse zones from the API server, on
    `port`; ``health`` for the liveness probe, ``ready`` (200 once the API server was read) for
    readiness, ``loop`` to stop on a forwarding loop, ``reload`` to follow the ConfigMap."""
    return f"""\
.:{port} {{
    errors
    health :{HEALTH_PORT}
    ready :{READY_PORT}
    kubernetes {domain} in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    cache 30
    loop
    reload
}}
"""


def _meta(name: str, *, namespaced: bool = True) -> Metadata:
    meta: Metadata = {"name": name, "labels": dict(LABELS)}
    if namespaced:
        meta["namespace"] = DNS_NAMESPACE
    return meta


def _probe(path: str, port: int, *, initial_delay_s: int, failures: int) -> Probe:
    return {
        "httpGet": {"path": path, "port": port, "scheme": "HTTP"},
        "initialDelaySeconds": initial_delay_s,
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def service(cluster_ip: str) -> Service:
    """``kube-dns`` at `cluster_ip`: port 53 over UDP and TCP to CoreDNS's ``DNS_CONTAINER_PORT``."""
    ports: list[ServicePort] = [
        {"name": "dns", "port": DNS_PORT, "protocol": "UDP", "targetPort": DNS_CONTAINER_PORT},
        {"name": "dns-tcp", "port": DNS_PORT, "protocol": "TCP", "targetPort": DNS_CONTAINER_PORT},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(DNS_SERVICE),
        "spec": {"clusterIP": cluster_ip, "selector": dict(LABELS), "ports": ports},
    }


def deployment(image: str) -> Deployment:
    """One CoreDNS pod of `image`, on any node whatever its taints, ahead of workloads for the
    scheduler (system-cluster-critical), resolving through its node (``dnsPolicy: Default``: it
    cannot use itself)."""
    container: Container = {
        "name": NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["-conf", f"{CONFIG_DIR}/Corefile"],
        "ports": [
            {"name": "dns", "containerPort": DNS_CONTAINER_PORT, "protocol": "UDP"},
            {"name": "dns-tcp", "containerPort": DNS_CONTAINER_PORT, "protocol": "TCP"},
        ],
        # Upstream's figures (kubeadm's CoreDNS Deployment).
        "resources": {"requests": {"cpu": "100m", "memory": "70Mi"}, "limits": {"memory": "170Mi"}},
        "readinessProbe": _probe("/ready", READY_PORT, initial_delay_s=0, failures=3),
        "livenessProbe": _probe("/health", HEALTH_PORT, initial_delay_s=60, failures=5),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(NAME),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": dict(LABELS)},
            "template": {
                "metadata": {"labels": dict(LABELS)},
                "spec": {
                    "serviceAccountName": NAME,
                    "priorityClassName": "system-cluster-critical",
                    "dnsPolicy": "Default",
                    "tolerations": [{"operator": "Exists"}],
                    "nodeSelector": {"kubernetes.io/os": "linux"},
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "config",
                            "configMap": {"name": NAME, "items": [{"key": "Corefile", "path": "Corefile"}]},
                        }
                    ],
                },
            },
        },
    }


def manifests(*, cluster_ip: str, image: str) -> tuple[Manifest, ...]:
    """Every object of the cluster's DNS, in the order they are applied (what a pod needs first)."""
    try:
        ipaddress.ip_address(cluster_ip)
    except ValueError as exc:
        raise ValueError(f"the DNS Service's ClusterIP must be an IP address, not {cluster_ip!r}") from exc
    if not image:
        raise ValueError("the CoreDNS image must be named")
    return (
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(NAME)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": _meta(f"system:{NAME}", namespaced=False),
            "rules": list(DNS_RULES),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": _meta(f"system:{NAME}", namespaced=False),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"system:{NAME}",
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": DNS_NAMESPACE}],
        },
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(NAME), "data": {"Corefile": corefile()}},
        service(cluster_ip),
        deployment(image),
    )


def object_path(manifest: Manifest) -> str:
    """The API path of `manifest`'s object."""
    base, resource = _COLLECTIONS[manifest["kind"]]
    meta = manifest["metadata"]
    namespace = f"/namespaces/{meta['namespace']}" if "namespace" in meta else ""
    return f"{base}{namespace}/{resource}/{meta['name']}"


async def ensure_cluster_dns(api: ApiClient, *, cluster_ip: str, image: str) -> None:
    """Apply the cluster's DNS (``manifests``) through `api`: CoreDNS of `image` behind ``kube-dns``
    at `cluster_ip` (in the API server's service range; the kubelets' ``clusterDNS``). Raises
    ``hamipy.kube.errors.KubeError`` naming the object the API server refused."""
    kube = RawKube(api)
    for manifest in manifests(cluster_ip=cluster_ip, image=image):
        await kube.request(
            "PATCH",
            object_path(manifest),
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=manifest,
            content_type=APPLY_PATCH,
        )
