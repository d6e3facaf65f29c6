"""kube-controller-manager in the dev cluster does what a cluster's does for the tests and `make up`:
ServiceAccounts and the root CA in every namespace, Deployments -> ReplicaSets -> Pods with scaling,
and deletion cascading to what an object owns."""

from __future__ import annotations

from typing import Any

import builders
import pytest

from hamipy.devcluster.cluster import DevCluster
from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.kube.errors import NotFound

pytestmark = pytest.mark.integration

APPS = "/apis/apps/v1"


def deployment(name: str, replicas: int) -> dict[str, Any]:
    # No node has this label: the pods stay Pending, which is all this test needs.
    spec = {
        "nodeSelector": {"hami-py.io/nowhere": "true"},
        "containers": [{"name": "main", "image": "registry.invalid/app:1"}],
    }
    return builders.deployment(name, replicas, spec)


async def test_a_new_namespace_gets_its_service_account_and_root_ca(
    devcluster: DevCluster, kube_client: Any, namespace: str
) -> None:
    kube = RawKube(kube_client)
    # create_namespace returned only once the ServiceAccount controller made `default`.
    account = await kube.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
    assert account["metadata"]["name"] == "default"

    async def published() -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await kube.request(
                "GET", f"/api/v1/namespaces/{namespace}/configmaps/kube-root-ca.crt"
            )
        except NotFound:
            return None
        return found

    root_ca = await wait_for(published, timeout=30, what="kube-root-ca.crt")
    assert root_ca["data"]["ca.crt"].strip() == devcluster.access.ca_file.read_text().strip()
    assert "kube-controller-manager" in devcluster.processes


async def test_a_deployment_scales_and_its_deletion_cascades(kube_client: Any, namespace: str) -> None:
    kube = RawKube(kube_client)
    pods_path = f"/api/v1/namespaces/{namespace}/pods"

    async def live() -> list[dict[str, Any]]:
        listed = await kube.request("GET", pods_path, query=[("labelSelector", "app=web")])
        return [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]

    async def pods(count: int) -> bool:
        return len(await live()) == count

    await kube.request("POST", f"{APPS}/namespaces/{namespace}/deployments", body=deployment("web", 2))
    await wait_for(lambda: pods(2), timeout=60, what="2 pods of the Deployment")
    (owner,) = {ref["kind"] for p in await live() for ref in p["metadata"]["ownerReferences"]}
    assert owner == "ReplicaSet"
    await kube.request(
        "PATCH",
        f"{APPS}/namespaces/{namespace}/deployments/web",
        body={"spec": {"replicas": 1}},
        content_type="application/merge-patch+json",
    )
    await wait_for(lambda: pods(1), timeout=60, what="the Deployment scaled to 1")
    await kube.request(
        "DELETE",
        f"{APPS}/namespaces/{namespace}/deployments/web",
        query=[("propagationPolicy", "Background")],
    )
    await wait_for(lambda: pods(0), timeout=60, what="the garbage collector to delete the pods")

    async def no_replica_sets() -> bool:
        listed = await kube.request("GET", f"{APPS}/namespaces/{namespace}/replicasets")
        return not listed["items"]

    assert await wait_for(no_replica_sets, timeout=60, what="the ReplicaSet deleted")
