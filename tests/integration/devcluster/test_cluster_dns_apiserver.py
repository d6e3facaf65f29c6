"""The cluster DNS objects (``cluster_dns.ensure_cluster_dns``) as the real API server takes them:
applied twice they are written once, a new image is rolled out, CoreDNS's account may read what
its ``kubernetes`` plugin watches, and a ClusterIP the server refuses is named.

A cluster of its own, without kube-controller-manager or kube-scheduler: the CoreDNS pod must not
be scheduled onto the simulated nodes other tests count, and nothing here needs it to run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from hamipy.devcluster.binaries import ensure_binaries
from hamipy.devcluster.cluster import ClusterSettings, DevCluster
from hamipy.devcluster.cluster_dns import (
    DNS_NAMESPACE,
    DNS_RULES,
    DNS_SERVICE,
    ensure_cluster_dns,
    manifests,
    object_path,
)
from hamipy.devcluster.identities import rights_in_force
from hamipy.kube.client import RawKube
from hamipy.kube.errors import KubeError, NotFound

pytestmark = pytest.mark.integration

CLUSTER_IP = "10.96.0.10"
"""In ``ClusterSettings.service_cluster_ip_range`` (10.96.0.0/16)."""
IMAGE = "hamipy.local/coredns:v1.14.7"


@pytest.fixture(scope="module")
def apiserver() -> Iterator[DevCluster]:
    settings = ClusterSettings(controller_manager=False, default_scheduler=False)
    with DevCluster(settings, binaries=ensure_binaries()) as cluster:
        yield cluster


@pytest.fixture
async def api(apiserver: DevCluster) -> AsyncIterator[Any]:
    async with apiserver.api_client() as client:
        yield client


async def versions(api: Any) -> dict[str, str]:
    """Each object's API path -> its resourceVersion."""
    kube = RawKube(api)
    return {
        path: (await kube.request("GET", path))["metadata"]["resourceVersion"]
        for path in map(object_path, manifests(cluster_ip=CLUSTER_IP, image=IMAGE))
    }


async def test_applying_twice_writes_the_objects_once(api: Any) -> None:
    await ensure_cluster_dns(api, cluster_ip=CLUSTER_IP, image=IMAGE)
    first = await versions(api)
    await ensure_cluster_dns(api, cluster_ip=CLUSTER_IP, image=IMAGE)
    assert await versions(api) == first
    service = await RawKube(api).request("GET", f"/api/v1/namespaces/{DNS_NAMESPACE}/services/{DNS_SERVICE}")
    assert service["spec"]["clusterIP"] == CLUSTER_IP


async def test_a_new_image_is_rolled_out(api: Any) -> None:
    await ensure_cluster_dns(api, cluster_ip=CLUSTER_IP, image=IMAGE)
    await ensure_cluster_dns(api, cluster_ip=CLUSTER_IP, image="hamipy.local/coredns:other")
    deployment = await RawKube(api).request(
        "GET", f"/apis/apps/v1/namespaces/{DNS_NAMESPACE}/deployments/coredns"
    )
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "hamipy.local/coredns:other"


async def test_coredns_may_read_what_it_watches_in_every_namespace(api: Any) -> None:
    await ensure_cluster_dns(api, cluster_ip=CLUSTER_IP, image=IMAGE)
    rules: list[dict[str, Any]] = [dict(rule) for rule in DNS_RULES]
    await rights_in_force(api, rules, [(DNS_NAMESPACE, "coredns")], namespace=None)


async def test_a_cluster_ip_outside_the_service_range_is_refused_naming_the_service(api: Any) -> None:
    with contextlib.suppress(NotFound):  # made by an earlier test: its IP may not change
        await RawKube(api).request("DELETE", f"/api/v1/namespaces/{DNS_NAMESPACE}/services/{DNS_SERVICE}")
    with pytest.raises(KubeError, match=rf"services/{DNS_SERVICE}: .*192\.0\.2\.10") as refused:
        await ensure_cluster_dns(api, cluster_ip="192.0.2.10", image=IMAGE)
    assert refused.value.status == 422
