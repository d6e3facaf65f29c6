"""The allocation-state admission policies in the real kube-apiserver, as tenants and as our services.

The policies are the shipped ones (``hamipy.webhook.admission_policy``); only their bindings are
narrowed to this test's namespace and nodes, so the rest of the session (which writes annotations as
admin to simulate the system) is not affected. No webhook runs here: the API server alone refuses.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hamipy.devcluster.cluster import DevCluster
from hamipy.devcluster.identities import (
    TENANT_POD_RULES,
    Identity,
    grant_cluster_role,
    grant_role,
    issue_identity,
)
from hamipy.devcluster.nodes import NodePool, NodeSpec
from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import MERGE_PATCH, RawKube
from hamipy.kube.errors import KubeError, NotFound
from hamipy.protocol import keys
from hamipy.webhook.admission_policy import (
    NODE_POLICY_NAME,
    POD_POLICY_NAME,
    admission_policies,
)
from hamipy.webhook.quota_policy import QUOTA_POLICY_NAME

pytestmark = pytest.mark.integration

ADMISSION = "/apis/admissionregistration.k8s.io/v1"
BOUND = {keys.BIND_PHASE: "allocating", keys.DEVICES_TO_ALLOCATE: "GPU-a,NVIDIA,1,0:;"}


def _pod(name: str, *, node: str | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox"}]}
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": spec,
    }


class Policies:
    """The shipped policies, bound to one namespace and the nodes labelled for this test."""

    def __init__(
        self, admin: RawKube, namespace: str, node_label: str, *, schedulers: list[str], plugins: list[str]
    ) -> None:
        self.admin, self.namespace, self.node_label = admin, namespace, node_label
        # The quota policy has its own test (test_quota_policy.py): it binds to ResourceQuotas.
        self.docs = [
            d
            for d in admission_policies(schedulers=schedulers, device_plugins=plugins)
            if not d["metadata"]["name"].endswith(QUOTA_POLICY_NAME)
        ]
        self.suffix = secrets.token_hex(3)

    def _named(self, doc: dict[str, Any]) -> dict[str, Any]:
        doc = {**doc, "metadata": {**doc["metadata"], "name": f"{doc['metadata']['name']}-{self.suffix}"}}
        if doc["kind"] == "ValidatingAdmissionPolicyBinding":
            spec = dict(doc["spec"], policyName=f"{doc['spec']['policyName']}-{self.suffix}")
            if doc["spec"]["policyName"].endswith(POD_POLICY_NAME):
                spec["matchResources"] = {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.namespace}}
                }
            else:
                assert doc["spec"]["policyName"].endswith(NODE_POLICY_NAME)
                spec["matchResources"] = {"objectSelector": {"matchLabels": {self.node_label: "true"}}}
            doc["spec"] = spec
        return doc

    def _path(self, doc: dict[str, Any]) -> str:
        plural = (
            "validatingadmissionpolicybindings"
            if doc["kind"].endswith("Binding")
            else "validatingadmissionpolicies"
        )
        return f"{ADMISSION}/{plural}"

    async def install(self) -> None:
        for doc in map(self._named, self.docs):
            await self.admin.request("POST", self._path(doc), body=doc)
        # The API server reads policies through an informer: wait until this one refuses.
        probe = _pod(f"probe-{self.suffix}", annotations={keys.BIND_PHASE: "success"})

        async def refuses() -> bool:
            try:
                await self.admin.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", body=probe)
            except KubeError as exc:
                return exc.status == 403
            await self.admin.request(
                "DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{probe['metadata']['name']}"
            )
            return False

        await wait_for(refuses, timeout=30, what="the admission policy in force")

    async def remove(self) -> None:
        for doc in reversed([self._named(d) for d in self.docs]):
            with contextlib.suppress(NotFound):
                await self.admin.request("DELETE", f"{self._path(doc)}/{doc['metadata']['name']}")


@pytest.fixture
async def rig(
    devcluster: DevCluster, kube_client: Any, namespace: str, node_pool: NodePool
) -> AsyncIterator[dict[str, Any]]:
    admin = RawKube(kube_client)
    access = devcluster.access
    label = {f"hami-py.io/policy-test-{namespace}": "true"}
    for name in ("a", "b"):
        await node_pool.add(NodeSpec(name=f"{namespace}-{name}", labels=label))

    async def identity(name: str, bound_node: str | None = None) -> Identity:
        return await issue_identity(
            kube_client,
            namespace=namespace,
            name=name,
            server=access.server,
            ca_file=access.ca_file,
            bound_node=bound_node,
        )

    tenant = await identity("tenant")
    await grant_role(kube_client, namespace=namespace, account="tenant", rules=TENANT_POD_RULES)
    editor = await identity("editor")  # a tenant who may also patch its pods
    await grant_role(
        kube_client,
        namespace=namespace,
        account="editor",
        rules=[{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "patch"]}],
    )
    scheduler = await identity("scheduler")
    plugin = await identity("plugin", bound_node=f"{namespace}-a")
    unbound_plugin = await identity("plugin")
    for account in ("scheduler", "plugin"):
        await grant_role(
            kube_client,
            namespace=namespace,
            account=account,
            rules=[{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "patch"]}],
        )
    await grant_cluster_role(
        kube_client,
        name=f"{namespace}-plugin-nodes",
        rules=[{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}],
        accounts=[(namespace, "plugin")],
    )
    policies = Policies(
        admin, namespace, next(iter(label)), schedulers=[scheduler.user], plugins=[plugin.user]
    )
    await policies.install()
    clients = {
        name: ident.api_client()
        for name, ident in {
            "tenant": tenant,
            "editor": editor,
            "scheduler": scheduler,
            "plugin": plugin,
            "unbound_plugin": unbound_plugin,
        }.items()
    }
    # install() waited for the pod policy; the node policy reaches the API server's informer on its
    # own, so wait until it refuses the bound plugin an update of the other node too.
    probe = {"metadata": {"annotations": {"hami-py.io/policy-probe": policies.suffix}}}

    async def node_policy_in_force() -> bool:
        try:
            await RawKube(clients["plugin"]).request(
                "PATCH", f"/api/v1/nodes/{namespace}-b", body=probe, content_type=MERGE_PATCH
            )
        except KubeError as exc:
            return exc.status == 403
        return False

    try:
        await wait_for(node_policy_in_force, timeout=30, what="the node admission policy in force")
        yield {"namespace": namespace, "admin": admin, **{k: RawKube(v) for k, v in clients.items()}}
    finally:
        await policies.remove()
        for client in clients.values():
            await client.close()
        with contextlib.suppress(NotFound):
            await admin.request(
                "DELETE", f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{namespace}-plugin-nodes"
            )
            await admin.request(
                "DELETE", f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{namespace}-plugin-nodes"
            )


async def _refused(kube: RawKube, method: str, path: str, body: Any, *, patch: bool = False) -> str:
    kwargs: dict[str, Any] = {"body": body}
    if patch:
        kwargs["content_type"] = "application/merge-patch+json"
    with pytest.raises(KubeError) as caught:
        await kube.request(method, path, **kwargs)
    assert caught.value.status == 403, caught.value
    return str(caught.value)


async def test_a_tenant_cannot_create_a_pod_carrying_allocation_state(rig: dict[str, Any]) -> None:
    ns, tenant = rig["namespace"], rig["tenant"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    # The hijack: a pod asking no GPU (the webhook never sees it), bound, with a slot pre-set.
    hijack = _pod(
        "hijack", node=f"{ns}-a", annotations={**BOUND, keys.DEVICES_ALLOCATED: "GPU-a,NVIDIA,1,0:;"}
    )
    message = await _refused(tenant, "POST", pods, hijack)
    for part in (keys.BIND_PHASE, keys.DEVICES_ALLOCATED, "carries GPU allocation state", "tenant may not"):
        assert part in message
    # The block: an unbound pod claiming a node's GPUs, by annotation or by label.
    claim = _pod("claim", annotations={keys.VGPU_NODE: f"{ns}-a"})
    assert keys.VGPU_NODE in await _refused(tenant, "POST", pods, claim)
    labelled = _pod("labelled")
    labelled["metadata"]["labels"] = {keys.VGPU_NODE_LABEL: f"{ns}-a"}
    assert keys.VGPU_NODE_LABEL in await _refused(tenant, "POST", pods, labelled)
    # Admin is no exception (a controller creating a pod from a template is not the scheduler).
    await _refused(rig["admin"], "POST", pods, _pod("by-admin", annotations={keys.BIND_TIME: "1"}))
    # A pod with other annotations of ours (user preferences) is fine.
    created = await tenant.request("POST", pods, body=_pod("ok", annotations={keys.USE_GPU_TYPE: "A100"}))
    assert created["metadata"]["annotations"] == {keys.USE_GPU_TYPE: "A100"}


async def test_a_tenant_cannot_write_allocation_state_through_a_binding(rig: dict[str, Any]) -> None:
    """The extender writes the allocation with the pod's Binding, which the pod policy does not see:
    creating Bindings is a scheduler's right, which a tenant (nor Kubernetes' edit or admin role)
    does not have."""
    ns, tenant = rig["namespace"], rig["tenant"]
    created = await tenant.request("POST", f"/api/v1/namespaces/{ns}/pods", body=_pod("mine"))
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "mine", "annotations": {**BOUND, keys.DEVICES_ALLOCATED: "GPU-a,NVIDIA,1,0:;"}},
        "target": {"apiVersion": "v1", "kind": "Node", "name": f"{ns}-a"},
    }
    message = await _refused(tenant, "POST", f"/api/v1/namespaces/{ns}/pods/mine/binding", binding)
    assert 'cannot create resource "pods/binding"' in message
    assert created["metadata"].get("annotations") is None
    for role in ("edit", "admin"):
        found = await rig["admin"].request("GET", f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{role}")
        granted = [
            r
            for r in found.get("rules") or []
            if {"pods/binding", "*"} & set(r.get("resources") or ())
            and {"create", "*"} & set(r.get("verbs") or ())
        ]
        assert granted == [], f"the {role} role lets tenants bind pods: {granted}"


async def test_updates_by_others_cannot_set_change_or_remove_allocation_state(rig: dict[str, Any]) -> None:
    ns, editor, scheduler = rig["namespace"], rig["editor"], rig["scheduler"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    await editor.request("POST", pods, body=_pod("p"))
    message = await _refused(editor, "PATCH", f"{pods}/p", {"metadata": {"annotations": BOUND}}, patch=True)
    assert "editor may not" in message
    # The scheduler may write the allocation; then the editor may neither change nor remove it.
    written = await scheduler.request(
        "PATCH",
        f"{pods}/p",
        body={"metadata": {"annotations": BOUND}},
        content_type="application/merge-patch+json",
    )
    assert written["metadata"]["annotations"][keys.BIND_PHASE] == "allocating"
    for change in ({keys.BIND_PHASE: "success"}, {keys.DEVICES_TO_ALLOCATE: None}):
        message = await _refused(
            editor, "PATCH", f"{pods}/p", {"metadata": {"annotations": change}}, patch=True
        )
        assert next(iter(change)) in message
    # Unrelated changes by the editor still go through, with the allocation untouched.
    done = await editor.request(
        "PATCH",
        f"{pods}/p",
        body={"metadata": {"annotations": {"team": "a"}}},
        content_type="application/merge-patch+json",
    )
    assert done["metadata"]["annotations"] == {**BOUND, "team": "a"}


async def test_the_device_plugin_writes_only_its_keys_on_its_own_nodes_pods(rig: dict[str, Any]) -> None:
    ns, scheduler, plugin, admin = rig["namespace"], rig["scheduler"], rig["plugin"], rig["admin"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    for name, node in (("on-a", f"{ns}-a"), ("on-b", f"{ns}-b")):
        await admin.request("POST", pods, body=_pod(name, node=node))
        await scheduler.request(
            "PATCH",
            f"{pods}/{name}",
            body={"metadata": {"annotations": BOUND}},
            content_type="application/merge-patch+json",
        )
    served = {keys.BIND_PHASE: "success", keys.DEVICES_TO_ALLOCATE: ";"}
    done = await plugin.request(
        "PATCH",
        f"{pods}/on-a",
        body={"metadata": {"annotations": served}},
        content_type="application/merge-patch+json",
    )
    assert done["metadata"]["annotations"][keys.BIND_PHASE] == "success"
    # Another node's pod: refused, naming the node the token is bound to.
    message = await _refused(
        plugin, "PATCH", f"{pods}/on-b", {"metadata": {"annotations": served}}, patch=True
    )
    assert f"bound to node {ns}-a" in message
    # A key only the scheduler writes: refused even on its own node.
    allocated = {keys.DEVICES_ALLOCATED: "GPU-a,NVIDIA,1,0:;"}
    await _refused(plugin, "PATCH", f"{pods}/on-a", {"metadata": {"annotations": allocated}}, patch=True)
    # The same account with a token bound to no node: refused.
    message = await _refused(
        rig["unbound_plugin"],
        "PATCH",
        f"{pods}/on-a",
        {"metadata": {"annotations": {keys.BIND_PHASE: "failed"}}},
        patch=True,
    )
    assert "bound to no node" in message


async def test_a_device_plugin_updates_only_its_own_node(rig: dict[str, Any]) -> None:
    ns, plugin = rig["namespace"], rig["plugin"]
    body = {"metadata": {"annotations": {keys.NODE_HANDSHAKE: "Reported 2026-11-24T00:00:00Z"}}}
    done = await plugin.request(
        "PATCH", f"/api/v1/nodes/{ns}-a", body=body, content_type="application/merge-patch+json"
    )
    assert done["metadata"]["annotations"][keys.NODE_HANDSHAKE].startswith("Reported")
    message = await _refused(plugin, "PATCH", f"/api/v1/nodes/{ns}-b", body, patch=True)
    assert f"node {ns}-b: a device plugin updates only its own node" in message
