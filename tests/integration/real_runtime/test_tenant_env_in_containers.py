"""A tenant cannot lift its GPU pod's limits with the pod's own environment, on real containers:
what the process really sees and gets is asserted, not what the spec says (docs/security.md).

The tenant is a ServiceAccount with pod rights only in its namespace. Naming the limit variables,
``LD_PRELOAD``, ``CUDA_DISABLE_CONTROL`` or ``NVIDIA_VISIBLE_DEVICES`` in the pod's ``env`` is
refused at admission, naming the variable. An unprefixed ``envFrom`` of a ConfigMap cannot be judged
at admission, so there the values reach the container (checked inside it), and the process is
still held to its slice: the interposer is loaded by ``/etc/ld.so.preload`` whatever ``LD_PRELOAD``
says, and reads its limits from the read-only file beside it, not from the environment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from runtime_support import NEEDS_REAL_KUBELET, RuntimeStack, sees_only, workload
from stack_support import allocated_slots

from hamipy.devcluster import API_TIMEOUT_S
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.devcluster.identities import TENANT_POD_RULES, grant_role, issue_identity

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPUS = (
    FakeGpu("GPU-cccccccc-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-40GB", 40960),
    FakeGpu("GPU-cccccccc-0000-4000-8000-000000000001", "NVIDIA A100-SXM4-40GB", 40960),
)
LIMIT_MIB = 2000
LIFTED = {
    "CUDA_DEVICE_MEMORY_LIMIT_0": "40000m",
    "CUDA_DEVICE_MEMORY_LIMIT": "40000m",
    "CUDA_DEVICE_SM_LIMIT": "0",
    "CUDA_DISABLE_CONTROL": "true",
    "LD_PRELOAD": "",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/private.cache",
}


@pytest.fixture
async def tenant(runtime_stack: RuntimeStack, kube_client: Any) -> AsyncIterator[Any]:
    namespace, access = runtime_stack.stack.namespace, runtime_stack.devcluster.access
    identity = await issue_identity(
        kube_client, namespace=namespace, name="tenant", server=access.server, ca_file=access.ca_file
    )
    await grant_role(kube_client, namespace=namespace, account="tenant", rules=TENANT_POD_RULES)
    async with identity.api_client() as api:
        yield api


async def create_as(api: Any, namespace: str, body: dict[str, Any]) -> None:
    core: Any = client.CoreV1Api(api)  # its hint asks for a V1Pod; the client sends a JSON body as it is
    await core.create_namespaced_pod(namespace, body, _request_timeout=API_TIMEOUT_S)


@pytest.mark.parametrize(
    "name", ["CUDA_DEVICE_MEMORY_LIMIT_0", "LD_PRELOAD", "CUDA_DISABLE_CONTROL", "NVIDIA_VISIBLE_DEVICES"]
)
async def test_a_limit_variable_in_the_pods_env_is_refused(
    runtime_stack: RuntimeStack, tenant: Any, name: str
) -> None:
    stack = runtime_stack.stack
    body = stack.pod_body("lift", [workload(gpu=1, gpumem=LIMIT_MIB, gpucores=20, env={name: "all"})])
    with pytest.raises(client.ApiException) as refused:
        await create_as(tenant, stack.namespace, body)
    assert refused.value.status == 403
    assert name in str(refused.value.body)


async def test_limit_variables_from_a_config_map_reach_the_container_and_lift_nothing(
    runtime_stack: RuntimeStack, tenant: Any
) -> None:
    stack = runtime_stack.stack
    await stack.core.create_namespaced_config_map(
        stack.namespace,
        {"metadata": {"name": "lift"}, "data": LIFTED},  # type: ignore[arg-type]
        _request_timeout=API_TIMEOUT_S,
    )
    source = [{"configMapRef": {"name": "lift"}}]
    body = stack.pod_body("lifter", [workload(gpu=1, gpumem=LIMIT_MIB, gpucores=20, envFrom=source)])
    await create_as(tenant, stack.namespace, body)
    log = await runtime_stack.ready("lifter")

    # The threat is real: the container's environment holds the ConfigMap's values.
    env = await runtime_stack.env("lifter")
    assert {k: env.get(k) for k in LIFTED} == LIFTED
    # And lifts nothing: its own GPU, at its own size, refused past it, the interposer loaded.
    ((slot,),) = allocated_slots(await stack.pod("lifter"))
    sees_only(log, [slot.uuid], LIMIT_MIB)
    assert await runtime_stack.loaded_the_interposer("lifter")
