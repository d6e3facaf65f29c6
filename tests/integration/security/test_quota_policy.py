"""The GPU quota admission policy in the real kube-apiserver.

The shipped policy (``hamipy.manifests.quota_policy``) is bound to this test's namespace only; its
parameters are the namespace's own ResourceQuotas. A pod whose ask alone is over a quota's limit is
refused at creation, as a tenant with pod rights only sees it; one that fits, one that asks a
percentage (its charge depends on the GPU chosen: the extender's to check) and any pod of a
namespace without a quota are admitted.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hamipy.devcluster.cluster import DevCluster
from hamipy.devcluster.identities import TENANT_POD_RULES, grant_role, issue_identity
from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.kube.errors import KubeError, NotFound
from hamipy.manifests.quota_policy import quota_policy

pytestmark = pytest.mark.integration

ADMISSION = "/apis/admissionregistration.k8s.io/v1"


def _pod(name: str, *containers: dict[str, str], init: dict[str, str] | None = None) -> dict[str, Any]:
    def one(index: int, limits: dict[str, str]) -> dict[str, Any]:
        return {"name": f"c{index}", "image": "busybox", "resources": {"limits": limits}}

    spec: dict[str, Any] = {"containers": [one(i, c) for i, c in enumerate(containers)]}
    if init is not None:
        spec["initContainers"] = [one(9, init)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _gpus(count: int, **asks: int) -> dict[str, str]:
    return {"nvidia.com/gpu": str(count), **{f"nvidia.com/{k}": str(v) for k, v in asks.items()}}


@pytest.fixture
async def tenant(devcluster: DevCluster, kube_client: Any, namespace: str) -> AsyncIterator[RawKube]:
    """A tenant of ``namespace`` (pod rights only) with the policy bound there and a 16 GiB quota."""
    admin = RawKube(kube_client)
    suffix = secrets.token_hex(3)
    docs = quota_policy(f"test-{suffix}-")
    docs[1]["spec"]["matchResources"] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    }
    paths = [f"{ADMISSION}/validatingadmissionpolicies", f"{ADMISSION}/validatingadmissionpolicybindings"]
    for path, doc in zip(paths, docs, strict=True):
        await admin.request("POST", path, body=doc)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpu"},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "16384", "limits.nvidia.com/gpucores": "150"}},
    }
    await admin.request("POST", f"/api/v1/namespaces/{namespace}/resourcequotas", body=quota)
    identity = await issue_identity(
        kube_client,
        namespace=namespace,
        name="tenant",
        server=devcluster.access.server,
        ca_file=devcluster.access.ca_file,
    )
    await grant_role(kube_client, namespace=namespace, account="tenant", rules=TENANT_POD_RULES)
    client = identity.api_client()
    probe = _pod(f"probe-{suffix}", _gpus(1, gpumem=99999))

    # The API server reads policies and their parameters through informers: wait until it refuses.
    async def refuses() -> bool:
        try:
            await admin.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=probe)
        except KubeError as exc:
            return exc.status == 403
        await admin.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{probe['metadata']['name']}")
        return False

    await wait_for(refuses, timeout=30, what="the quota policy in force")
    try:
        yield RawKube(client)
    finally:
        await client.close()
        for path, doc in reversed(list(zip(paths, docs, strict=True))):
            with contextlib.suppress(NotFound):
                await admin.request("DELETE", f"{path}/{doc['metadata']['name']}")


async def _create(kube: RawKube, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = await kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=pod)
    return result


async def _refusal(kube: RawKube, namespace: str, pod: dict[str, Any]) -> str:
    with pytest.raises(KubeError) as caught:
        await _create(kube, namespace, pod)
    assert caught.value.status == 403, caught.value
    return str(caught.value)


async def test_a_pod_over_its_namespaces_quota_is_refused_naming_it(tenant: RawKube, namespace: str) -> None:
    message = await _refusal(tenant, namespace, _pod("big", _gpus(2, gpumem=12000)))
    assert "pod big asks 24000 MiB of nvidia.com/gpumem over its GPUs" in message
    assert f"ResourceQuota gpu allows namespace {namespace}" in message
    assert "limits.nvidia.com/gpumem: 16384" in message
    # Summed over app containers; cores likewise (2 x 80 % > 150).
    assert "20000 MiB" in await _refusal(
        tenant, namespace, _pod("two", _gpus(1, gpumem=10000), _gpus(1, gpumem=10000))
    )
    assert "160 percent of nvidia.com/gpucores" in await _refusal(
        tenant, namespace, _pod("cores", _gpus(2, gpucores=80))
    )
    # An init container runs alone: the largest one counts if it is more than the app containers.
    assert "20000 MiB" in await _refusal(
        tenant, namespace, _pod("init", _gpus(1, gpumem=1000), init=_gpus(1, gpumem=20000))
    )


async def test_pods_the_quota_could_admit_are_created(tenant: RawKube, namespace: str) -> None:
    fits = await _create(tenant, namespace, _pod("fits", _gpus(2, gpumem=8192, gpucores=75)))
    assert fits["metadata"]["name"] == "fits"
    # A percentage is charged by the extender, on the GPU it picks; the policy lets it through.
    share = {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "90"}
    await _create(tenant, namespace, _pod("share", share))
    # The init container is below the app containers' sum: the sum counts, and fits.
    await _create(tenant, namespace, _pod("init", _gpus(1, gpumem=8000), init=_gpus(1, gpumem=4000)))
    # A pod asking no GPU at all is none of the quota's business.
    await _create(tenant, namespace, _pod("cpu", {"cpu": "100m"}))


async def test_a_namespace_without_a_quota_admits(tenant: RawKube, kube_client: Any, namespace: str) -> None:
    admin = RawKube(kube_client)
    await admin.request("DELETE", f"/api/v1/namespaces/{namespace}/resourcequotas/gpu")

    async def admitted() -> bool:
        try:
            await _create(tenant, namespace, _pod("big", _gpus(2, gpumem=12000)))
        except KubeError as exc:
            if exc.status != 403:
                raise
            return False
        return True

    await wait_for(admitted, timeout=30, what="the pod admitted once the quota is gone")
