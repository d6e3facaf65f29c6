"""A tenant's GPU pods through the whole admission chain of the real kube-apiserver: the webhook
(``overwriteEnv`` on) and then the shipped admission policies, bound to the test's namespace.

The webhook's mutation must pass the policies (it may not add what they refuse), and what the
webhook refuses for GPU pods the policies refuse for every pod, so a tenant gets the same answer
whether or not the webhook sees the pod. The tenant is a ServiceAccount with pod rights only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import builders
import pytest
from policy_support import COVERING_MOUNTS, Policies, mounting_pod
from stack_support import start_webhook, stop_webhook

from hamipy.devcluster.cluster import DevCluster
from hamipy.devcluster.identities import TENANT_POD_RULES, grant_role, issue_identity
from hamipy.kube.client import RawKube
from hamipy.kube.errors import KubeError
from hamipy.protocol import keys
from hamipy.webhook.mutation import MutationSettings

pytestmark = pytest.mark.integration

WEBHOOK_DENIED = 'admission webhook "vgpu.webhook.hami-py.io" denied the request'


@pytest.fixture
async def tenant(
    devcluster: DevCluster, kube_client: Any, namespace: str, tmp_path: Path
) -> AsyncIterator[RawKube]:
    """The tenant's client, with the policies and then the webhook in force for its namespace."""
    policies = Policies(
        RawKube(kube_client), [namespace], "hami-py.io/none", schedulers=[], device_plugins=[]
    )
    await policies.install()
    webhook = await start_webhook(
        kube_client, namespace, tmp_path, settings=MutationSettings(overwrite_env=True)
    )
    access = devcluster.access
    identity = await issue_identity(
        kube_client, namespace=namespace, name="tenant", server=access.server, ca_file=access.ca_file
    )
    await grant_role(kube_client, namespace=namespace, account="tenant", rules=TENANT_POD_RULES)
    try:
        async with identity.api_client() as api:
            yield RawKube(api)
    finally:
        await stop_webhook(webhook)
        await policies.remove()


async def _refused(tenant: RawKube, namespace: str, body: dict[str, Any]) -> str:
    with pytest.raises(KubeError) as caught:
        await tenant.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
    assert caught.value.status == 403, caught.value
    return str(caught.value)


async def test_a_gpu_pod_is_admitted_mutated_and_passes_the_policies(tenant: RawKube, namespace: str) -> None:
    body = builders.pod(
        "train",
        builders.container("cuda", gpumem=3000, priority=0),
        builders.container("sidecar", limits={"cpu": "100m"}),
        init=[builders.container("setup")],
    )
    pod = await tenant.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
    spec = pod["spec"]
    assert spec["schedulerName"] == "hami-scheduler"
    cuda, sidecar = spec["containers"]
    assert cuda["resources"]["limits"][keys.RESOURCE_COUNT] == "1"
    # The device plugin gives the priority with the limits; the pod's own env stays the author's.
    assert "env" not in cuda
    assert sidecar["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]
    assert spec["initContainers"][0]["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]
    assert keys.TRACE_CONTEXT in pod["metadata"]["annotations"]


async def test_a_gpu_pod_of_another_scheduler_is_refused(tenant: RawKube, namespace: str) -> None:
    """An intruder with its own scheduler, a node of its choice and a GPU: refused for the node;
    and without one, for the scheduler, which only an admin can allow."""
    gpu = builders.container(gpu=1)
    pinned = builders.pod("intruder", gpu, scheduler_name="my-scheduler", node_name="gpu-node-1")
    message = await _refused(tenant, namespace, pinned)
    assert WEBHOOK_DENIED in message
    assert "spec.nodeName" in message
    unpinned = builders.pod("intruder", gpu, scheduler_name="my-scheduler")
    message = await _refused(tenant, namespace, unpinned)
    assert WEBHOOK_DENIED in message
    assert "'my-scheduler'" in message
    assert "allowedSchedulers" in message


@pytest.mark.parametrize(
    ("env", "env_from", "shown"),
    [
        pytest.param(
            {"CUDA_DEVICE_MEMORY_LIMIT_0": "20000m"}, None, "CUDA_DEVICE_MEMORY_LIMIT_0", id="limit"
        ),
        pytest.param({"CUDA_DISABLE_CONTROL": "true"}, None, "CUDA_DISABLE_CONTROL", id="no-interposer"),
        pytest.param(
            {"GPU_CORE_UTILIZATION_POLICY": "disable"}, None, "GPU_CORE_UTILIZATION_POLICY", id="policy"
        ),
        pytest.param(None, "CUDA_DEVICE_", "prefix 'CUDA_DEVICE_'", id="env-from-prefix"),
    ],
)
async def test_a_gpu_pod_cannot_set_its_own_limits(
    tenant: RawKube, namespace: str, env: dict[str, str] | None, env_from: str | None, shown: str
) -> None:
    fields: dict[str, Any] = {}
    if env_from is not None:
        fields["envFrom"] = [{"prefix": env_from, "configMapRef": {"name": "limits"}}]
    body = builders.pod("greedy", builders.container("cuda", gpu=1, gpumem=10000, env=env, **fields))
    message = await _refused(tenant, namespace, body)
    assert WEBHOOK_DENIED in message
    assert "'cuda'" in message
    assert shown in message


async def test_a_pod_without_gpus_cannot_choose_the_nodes_gpus(tenant: RawKube, namespace: str) -> None:
    """The webhook never sees this pod (it asks none of our resources): the policy refuses it."""
    visible = builders.pod("all-gpus", builders.container(env={"NVIDIA_VISIBLE_DEVICES": "all"}))
    message = await _refused(tenant, namespace, visible)
    assert WEBHOOK_DENIED not in message
    assert "NVIDIA_VISIBLE_DEVICES" in message
    hidden = builders.pod("no-gpus", builders.container(env={"NVIDIA_VISIBLE_DEVICES": "none"}))
    pod = await tenant.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=hidden)
    assert pod["spec"]["containers"][0]["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]


async def test_no_pod_names_cdi_devices_through_its_annotations(tenant: RawKube, namespace: str) -> None:
    """A runtime may take CDI devices from ``cdi.k8s.io/`` pod annotations: a GPU pod naming
    another pod's slot is refused by the webhook first; a pod asking no GPU and naming a whole GPU,
    which the webhook never sees, by the policy."""
    slot = builders.pod(
        "thief",
        builders.container("cuda", gpu=1),
        annotations={"cdi.k8s.io/mine": "hami.io/vgpu=0b1e6c6e-0000-4000-8000-000000000000_main"},
    )
    message = await _refused(tenant, namespace, slot)
    assert WEBHOOK_DENIED in message
    assert "annotation cdi.k8s.io/mine: a runtime can take CDI devices" in message
    gpu = builders.pod(
        "whole-gpu",
        builders.container(),
        annotations={"cdi.k8s.io/x": "nvidia.com/gpu=GPU-aaaaaaaa-0000-4000-8000-000000000000"},
    )
    message = await _refused(tenant, namespace, gpu)
    assert WEBHOOK_DENIED not in message
    assert "pod whole-gpu: annotation cdi.k8s.io/x: a runtime can take CDI devices" in message


async def test_a_gpu_pod_cannot_cover_the_device_plugins_mounts(tenant: RawKube, namespace: str) -> None:
    """The webhook refuses first, with its own message naming the container, the volume and the path;
    volumes elsewhere, and in pods asking no GPU, are admitted (and the GPU pod mutated)."""
    pods = f"/api/v1/namespaces/{namespace}/pods"
    wrong = []
    for case, path, source, sub_path in COVERING_MOUNTS:
        try:
            await tenant.request("POST", pods, body=mounting_pod(f"cover-{case}", path, source, sub_path))
        except KubeError as exc:
            shown = f"containers[0] 'cuda' mounts volume 'mine' at {path!r}:"
            if exc.status == 403 and WEBHOOK_DENIED in str(exc) and shown in str(exc):
                continue
            wrong.append(f"{case}: {exc.status} {exc}")
        else:
            wrong.append(f"{case}: admitted")
    assert wrong == [], "GPU pods covering the device plugin's mounts, not refused by the webhook"
    for name, path in (("etc2", "/etc2"), ("data", "/data"), ("vgpu2", "/usr/local/vgpu2")):
        pod = await tenant.request("POST", pods, body=mounting_pod(name, path))
        assert pod["spec"]["schedulerName"] == "hami-scheduler"
    plain = await tenant.request("POST", pods, body=mounting_pod("plain", "/etc/ld.so.preload", gpu=False))
    assert plain["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == "/etc/ld.so.preload"
