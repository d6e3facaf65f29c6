"""Identities other than admin on a dev cluster: ServiceAccounts, their rights, their tokens.

The services of ``make up`` and the tenants of the security tests act as real ServiceAccounts with
bearer tokens from the TokenRequest API, so RBAC and admission policies see them as a cluster would:
``system:serviceaccount:<namespace>:<name>`` in the groups ``system:serviceaccounts`` and
``system:serviceaccounts:<namespace>``. A token bound to a Node object carries the
``authentication.kubernetes.io/node-name`` claim, as a device plugin pod's projected token does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import yaml

from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.kube.errors import Conflict

__all__ = [
    "SERVICE_RULES",
    "SYSTEM_NAMESPACE",
    "TENANT_POD_RULES",
    "Identity",
    "ServiceIdentities",
    "grant_cluster_role",
    "grant_role",
    "issue_identity",
    "rights_in_force",
]

RBAC_TIMEOUT_S: Final = 30.0
"""How long ``rights_in_force`` waits for the authorizer to apply a new grant."""
TOKEN_SECONDS: Final = 86_400
"""A day, as long as the dev cluster's certificates live."""
TENANT_POD_RULES: Final = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "delete"]},
)
"""What a hostile tenant of the security tests may do: pods in its own namespace, nothing else."""
SYSTEM_NAMESPACE: Final = "hami-system"
SERVICE_RULES: Final[dict[str, tuple[dict[str, Any], ...]]] = {
    "extender": (
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": [""], "resources": ["resourcequotas"], "verbs": ["list", "watch"]},
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["list", "watch"]},
    ),
    "device-plugin": (
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ),
    "monitor": ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},),
}
"""Each service's ClusterRole: the chart's (a chart test checks they are equal), so ``make up``
runs the services with the rights an install gives them."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """A ServiceAccount's bearer token and what a client needs besides it."""

    user: str
    token: str
    server: str
    ca_file: Path

    def api_configuration(self) -> Any:
        from kubernetes_asyncio.client import Configuration

        cfg = Configuration(
            host=self.server, api_key={"BearerToken": self.token}, api_key_prefix={"BearerToken": "Bearer"}
        )
        cfg.ssl_ca_cert = str(self.ca_file)
        cfg.verify_ssl = True
        return cfg

    def api_client(self) -> Any:
        """A new kubernetes_asyncio ApiClient acting as this identity; the caller closes it."""
        from kubernetes_asyncio.client import ApiClient

        return ApiClient(configuration=self.api_configuration())

    def write_kubeconfig(self, path: Path) -> Path:
        name = self.user.rsplit(":", 1)[-1]
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "devcluster",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": name, "user": {"token": self.token}}],
            "contexts": [{"name": name, "context": {"cluster": "devcluster", "user": name}}],
            "current-context": name,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        path.chmod(0o600)
        return path


async def _create(kube: RawKube, path: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(Conflict):
        await kube.request("POST", path, body=body)


async def issue_identity(
    api: Any, *, namespace: str, name: str, server: str, ca_file: Path, bound_node: str | None = None
) -> Identity:
    """Create ServiceAccount ``namespace/name`` (if missing) and a token for it, bound to Node
    ``bound_node`` when given (the token then names that node, and dies with it)."""
    kube = RawKube(api)
    await _create(
        kube,
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
    )
    spec: dict[str, Any] = {"audiences": [], "expirationSeconds": TOKEN_SECONDS}
    if bound_node is not None:
        node = await kube.request("GET", f"/api/v1/nodes/{bound_node}")
        uid = node["metadata"]["uid"]
        spec["boundObjectRef"] = {"kind": "Node", "apiVersion": "v1", "name": bound_node, "uid": uid}
    review = await kube.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    return Identity(
        user=f"system:serviceaccount:{namespace}:{name}",
        token=str(review["status"]["token"]),
        server=server,
        ca_file=ca_file,
    )


def _subject(namespace: str, name: str) -> dict[str, str]:
    return {"kind": "ServiceAccount", "name": name, "namespace": namespace}


async def grant_role(api: Any, *, namespace: str, account: str, rules: Sequence[dict[str, Any]]) -> None:
    """A Role in ``namespace`` with ``rules``, bound to ServiceAccount ``namespace/account``."""
    kube = RawKube(api)
    role = f"{account}-rights"
    base = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    await _create(kube, f"{base}/roles", {"metadata": {"name": role}, "rules": list(rules)})
    await _create(
        kube,
        f"{base}/rolebindings",
        {
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [_subject(namespace, account)],
        },
    )
    await rights_in_force(api, rules, [(namespace, account)], namespace=namespace)


async def grant_cluster_role(
    api: Any, *, name: str, rules: Sequence[dict[str, Any]], accounts: Sequence[tuple[str, str]]
) -> None:
    """ClusterRole ``name`` with ``rules``, bound to the ServiceAccounts ``(namespace, name)``."""
    kube = RawKube(api)
    base = "/apis/rbac.authorization.k8s.io/v1"
    await _create(kube, f"{base}/clusterroles", {"metadata": {"name": name}, "rules": list(rules)})
    await _create(
        kube,
        f"{base}/clusterrolebindings",
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [_subject(ns, account) for ns, account in accounts],
        },
    )
    await rights_in_force(api, rules, accounts, namespace=None)


async def rights_in_force(
    api: Any,
    rules: Sequence[dict[str, Any]],
    accounts: Sequence[tuple[str, str]],
    *,
    namespace: str | None,
    timeout_s: float = RBAC_TIMEOUT_S,
) -> None:
    """Wait until the API server's authorizer allows each ServiceAccount ``(namespace, name)``
    every verb on every resource ``rules`` name, in ``namespace`` (None: cluster-wide), with a
    SubjectAccessReview each; ``WaitTimeout`` after ``timeout_s``. A new binding reaches the
    authorizer's cache a moment after it is written, and under load a first request in between is
    refused (``grant_role`` and ``grant_cluster_role`` wait for it). Rules are checked without a
    resource name: a rule limited by ``resourceNames`` is never allowed that way, and
    ``nonResourceURLs`` are not checked."""
    kube = RawKube(api)
    reviews = [
        _review(ns, account, group, resource, verb, namespace)
        for ns, account in accounts
        for rule in rules
        for group in rule.get("apiGroups", ())
        for resource in rule.get("resources", ())
        for verb in rule.get("verbs", ())
    ]

    async def allowed() -> bool:
        for review in reviews:
            answer = await kube.request(
                "POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body=review
            )
            if not (answer.get("status") or {}).get("allowed"):
                return False
        return True

    names = ", ".join(f"{ns}/{account}" for ns, account in accounts)
    await wait_for(allowed, timeout=timeout_s, interval=0.05, what=f"the rights granted to {names} in force")


def _review(
    namespace: str, account: str, group: str, resource: str, verb: str, where: str | None
) -> dict[str, Any]:
    resource, _, subresource = resource.partition("/")
    attributes = {"group": group, "resource": resource, "subresource": subresource, "verb": verb}
    if where is not None:
        attributes["namespace"] = where
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{namespace}:{account}",
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace}",
                "system:authenticated",
            ],
            "resourceAttributes": attributes,
        },
    }


class ServiceIdentities:
    """The services' ServiceAccounts in ``hami-system`` with their ClusterRoles, and kubeconfigs
    for them: ``kubeconfig("extender")``, or ``kubeconfig("device-plugin", bound_node="n")`` for a
    token that names its node (what the device plugin's admission policy checks)."""

    def __init__(self, api: Any, *, server: str, ca_file: Path, workdir: Path) -> None:
        self.api, self.server, self.ca_file, self.workdir = api, server, ca_file, workdir
        self._granted: set[str] = set()

    @staticmethod
    def account(service: str) -> str:
        return f"hamipy-{service}"

    def user(self, service: str) -> str:
        return f"system:serviceaccount:{SYSTEM_NAMESPACE}:{self.account(service)}"

    async def kubeconfig(self, service: str, *, bound_node: str | None = None) -> Path:
        from hamipy.devcluster.kubeobjects import ensure_namespace

        account = self.account(service)
        if service not in self._granted:
            await ensure_namespace(self.api, SYSTEM_NAMESPACE)
            await grant_cluster_role(
                self.api, name=account, rules=SERVICE_RULES[service], accounts=[(SYSTEM_NAMESPACE, account)]
            )
            self._granted.add(service)
        identity = await issue_identity(
            self.api,
            namespace=SYSTEM_NAMESPACE,
            name=account,
            server=self.server,
            ca_file=self.ca_file,
            bound_node=bound_node,
        )
        name = f"{account}-{bound_node}" if bound_node else account
        return identity.write_kubeconfig(self.workdir / "identities" / f"{name}.kubeconfig")
