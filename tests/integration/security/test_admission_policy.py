"""The admission policies in the real kube-apiserver, as tenants and as our services: who writes
allocation state, who places GPU pods, the env a pod may not set, and where a GPU container's own
volumes may not go.

The policies are the shipped ones (``hamipy.manifests.admission_policy``), bound to this test's
namespace and nodes only (``policy_support``). No webhook runs here: the API server alone refuses,
as it does while the webhook is down or for a namespace the webhook skips.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import builders
import pytest
from policy_support import ADMISSION, COVERING_MOUNTS, Policies, mounting_pod

from hamipy.devcluster.cluster import DevCluster
from hamipy.devcluster.identities import (
    TENANT_POD_RULES,
    Identity,
    grant_cluster_role,
    grant_role,
    issue_identity,
)
from hamipy.devcluster.kubeobjects import create_namespace, delete_namespace
from hamipy.devcluster.nodes import NodePool, NodeSpec
from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import MERGE_PATCH, RawKube
from hamipy.kube.errors import KubeError, NotFound
from hamipy.protocol import keys
from hamipy.protocol.allocation_env import LD_SO_PRELOAD

pytestmark = pytest.mark.integration

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
        rules=[
            {
                "apiGroups": [""],
                "resources": ["pods", "pods/ephemeralcontainers"],
                "verbs": ["create", "get", "patch"],
            }
        ],
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
        admin, [namespace], next(iter(label)), schedulers=[scheduler.user], device_plugins=[plugin.user]
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


async def _answer(kube: RawKube, path: str, body: Any) -> str:
    """``admitted``, or the refusal's status and message."""
    try:
        await kube.request("POST", path, body=body)
    except KubeError as exc:
        return f"{exc.status}: {exc}"
    return "admitted"


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
        content_type=MERGE_PATCH,
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
        content_type=MERGE_PATCH,
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
            content_type=MERGE_PATCH,
        )
    served = {keys.BIND_PHASE: "success", keys.DEVICES_TO_ALLOCATE: ";"}
    done = await plugin.request(
        "PATCH",
        f"{pods}/on-a",
        body={"metadata": {"annotations": served}},
        content_type=MERGE_PATCH,
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


# HAMi's MIG reservation of one device, as the scheduler writes it and as the plugin completes it.
MIG_RESERVED = (
    '[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.5gb",'
    '"placement":{"start":6,"size":1}}]'
)
MIG_MADE = MIG_RESERVED[:-2] + ',"migUUID":"MIG-a","gpuInstanceID":13,"computeInstanceID":0}]'


async def test_mig_allocations_are_written_by_the_scheduler_and_the_plugin_only(rig: dict[str, Any]) -> None:
    """A tenant who could write ``hami.io/vgpu-mig-allocations`` could have the device plugin carve
    an instance where it chose, over another pod's, or adopt another pod's instance."""
    ns, tenant, editor = rig["namespace"], rig["tenant"], rig["editor"]
    scheduler, plugin, admin = rig["scheduler"], rig["plugin"], rig["admin"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    hijack = _pod("mig-hijack", annotations={keys.MIG_ALLOCATIONS: MIG_MADE})
    message = await _refused(tenant, "POST", pods, hijack)
    assert keys.MIG_ALLOCATIONS in message
    assert "tenant may not" in message
    await admin.request("POST", pods, body=_pod("mig", node=f"{ns}-a"))
    await scheduler.request(
        "PATCH",
        f"{pods}/mig",
        body={"metadata": {"annotations": {**BOUND, keys.MIG_ALLOCATIONS: MIG_RESERVED}}},
        content_type=MERGE_PATCH,
    )
    for change in ({keys.MIG_ALLOCATIONS: MIG_MADE}, {keys.MIG_ALLOCATIONS: None}):
        message = await _refused(
            editor, "PATCH", f"{pods}/mig", {"metadata": {"annotations": change}}, patch=True
        )
        assert keys.MIG_ALLOCATIONS in message
        assert "editor may not" in message
    # The node's device plugin records the instance it made.
    done = await plugin.request(
        "PATCH",
        f"{pods}/mig",
        body={"metadata": {"annotations": {keys.MIG_ALLOCATIONS: MIG_MADE}}},
        content_type=MERGE_PATCH,
    )
    assert done["metadata"]["annotations"][keys.MIG_ALLOCATIONS] == MIG_MADE


async def test_a_device_plugin_updates_only_its_own_node(rig: dict[str, Any]) -> None:
    ns, plugin = rig["namespace"], rig["plugin"]
    body = {"metadata": {"annotations": {keys.NODE_HANDSHAKE: "Reported 2026-11-24T00:00:00Z"}}}
    done = await plugin.request("PATCH", f"/api/v1/nodes/{ns}-a", body=body, content_type=MERGE_PATCH)
    assert done["metadata"]["annotations"][keys.NODE_HANDSHAKE].startswith("Reported")
    message = await _refused(plugin, "PATCH", f"/api/v1/nodes/{ns}-b", body, patch=True)
    assert f"node {ns}-b: a device plugin updates only its own node" in message


# -- CDI devices come from the device plugin, not from a pod's annotations -------------------------------


async def test_no_pod_is_created_or_updated_with_cdi_annotations(rig: dict[str, Any]) -> None:
    """The hijack of a runtime that takes CDI devices from pod annotations: another pod's slot (its
    limits) or a whole GPU (none), by a tenant, on create or by a later update, or by admin."""
    ns, tenant, editor = rig["namespace"], rig["tenant"], rig["editor"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    names = {
        "slot": "hami.io/vgpu=0b1e6c6e-0000-4000-8000-000000000000_main",
        "gpu": "nvidia.com/gpu=GPU-aaaaaaaa-0000-4000-8000-000000000000",
    }
    for case, device in names.items():
        body = builders.pod(f"cdi-{case}", builders.container(), annotations={f"cdi.k8s.io/{case}": device})
        message = await _refused(tenant, "POST", pods, body)
        assert f"pod cdi-{case}: annotation cdi.k8s.io/{case}: a runtime can take CDI devices" in message
    await _refused(rig["admin"], "POST", pods, _pod("by-admin", annotations={"cdi.k8s.io/x": names["gpu"]}))
    await editor.request("POST", pods, body=_pod("later"))
    for change in ({"cdi.k8s.io/x": names["gpu"]}, {"cdi.k8s.io/y": names["slot"]}):
        body = {"metadata": {"annotations": change}}
        message = await _refused(editor, "PATCH", f"{pods}/later", body, patch=True)
        assert f"annotation {next(iter(change))}" in message
    # Other annotations, at creation and later, are the author's.
    done = await editor.request(
        "PATCH", f"{pods}/later", body={"metadata": {"annotations": {"team": "a"}}}, content_type=MERGE_PATCH
    )
    assert done["metadata"]["annotations"] == {"team": "a"}


# -- GPU pods are placed by a scheduler, not by their authors -------------------------------------------


@pytest.mark.parametrize(
    "gpu_pod",
    [
        pytest.param(
            lambda node: builders.pod("pinned", builders.container(gpu=1), node_name=node), id="count"
        ),
        pytest.param(
            lambda node: builders.pod(
                "pinned", builders.container(), init=[builders.container("init", gpumem=1000)], node_name=node
            ),
            id="init-container-memory",
        ),
        pytest.param(
            lambda node: builders.pod(
                "pinned", builders.container(), builders.container("second", gpucores=30), node_name=node
            ),
            id="second-container-cores",
        ),
    ],
)
async def test_a_tenant_cannot_place_a_gpu_pod_on_a_node(rig: dict[str, Any], gpu_pod: Any) -> None:
    """The tenant's pod of another scheduler (or none) with ``spec.nodeName``: without this rule it
    reaches the kubelet without any scheduler of ours seeing it, and can take a waiting pod's slot."""
    ns, tenant = rig["namespace"], rig["tenant"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    body = gpu_pod(f"{ns}-a")
    body["spec"]["schedulerName"] = "my-scheduler"
    message = await _refused(tenant, "POST", pods, body)
    for part in ("pod pinned", "spec.nodeName", f"{ns}-a", f"system:serviceaccount:{ns}:tenant may not"):
        assert part in message
    # A scheduler's identity may (a scheduler that creates pods already placed), and a pod asking
    # no GPU may name its node as any pod may.
    created = await rig["scheduler"].request("POST", pods, body=body)
    assert created["spec"]["nodeName"] == f"{ns}-a"
    plain = builders.pod("plain", builders.container(limits={"cpu": "100m"}), node_name=f"{ns}-a")
    assert (await tenant.request("POST", pods, body=plain))["spec"]["nodeName"] == f"{ns}-a"


# -- the env a pod may not set ---------------------------------------------------------------------------

GPU_RESERVED = (
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_DEVICE_MEMORY_LIMIT_0",
    "CUDA_DEVICE_MEMORY_LIMIT_15",
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_DEVICE_SM_LIMIT_3",
    "CUDA_TASK_PRIORITY",
    "CUDA_DISABLE_CONTROL",
    "GPU_CORE_UTILIZATION_POLICY",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "CUDA_OVERSUBSCRIBE",
    "LD_PRELOAD",
)
"""What a GPU container's own spec may not set: its limits, its priority, the interposer's switches."""


async def test_a_gpu_container_cannot_set_its_own_limits(rig: dict[str, Any]) -> None:
    ns, tenant = rig["namespace"], rig["tenant"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    wrong = []
    for i, name in enumerate(GPU_RESERVED):
        own = {"CUDA_VISIBLE_DEVICES": "0", name: "20000m"}
        for where, body in (
            ("limits", builders.pod(f"own-{i}", builders.container("cuda", gpu=1, gpumem=10000, env=own))),
            (
                "a second container",
                builders.pod(
                    f"own-second-{i}", builders.container(), builders.container("cuda", gpu=2, env=own)
                ),
            ),
            (
                "init container",
                builders.pod(
                    f"own-init-{i}", builders.container(), init=[builders.container("cuda", gpu=1, env=own)]
                ),
            ),
        ):
            answer = await _answer(tenant, pods, body)
            if not answer.startswith("403") or f"container cuda sets {name}" not in answer:
                wrong.append(f"{name} in {where}: {answer}")
    assert wrong == [], "pods that set their own GPU limits, not refused for it"
    # Containers that ask no GPU get no slice: the same names mean nothing there.
    sidecar = builders.container("sidecar", env=dict.fromkeys(GPU_RESERVED, "1"))
    for body in (
        builders.pod("with-sidecar", builders.container("cuda", gpu=1), sidecar),
        builders.pod("no-gpu", sidecar),
    ):
        await tenant.request("POST", pods, body=body)


@pytest.mark.parametrize(
    ("gpu", "prefix", "refused"),
    [
        pytest.param(True, "CUDA_", True, id="gpu-CUDA_"),
        pytest.param(True, "CUDA_DEVICE_SM_LIMIT_1", True, id="gpu-per-device"),
        pytest.param(True, "LD_", True, id="gpu-LD_"),
        pytest.param(True, "N", True, id="gpu-N"),
        pytest.param(True, "CUDA_DEVICE_MEMORY_LIMIT_X", False, id="gpu-no-reserved-name-follows"),
        pytest.param(True, "APP_", False, id="gpu-APP_"),
        pytest.param(True, None, False, id="gpu-no-prefix"),
        pytest.param(False, "NVIDIA_", True, id="plain-NVIDIA_"),
        pytest.param(False, "CUDA_", False, id="plain-CUDA_"),
    ],
)
async def test_env_from_with_a_prefix_that_could_make_a_reserved_name(
    rig: dict[str, Any], gpu: bool, prefix: str | None, refused: bool
) -> None:
    """A ConfigMap's keys are not known at admission (and may change later), so a source is judged
    by its prefix: one that a reserved name starts with could set it. Without a prefix it is
    admitted (docs/security.md says why that leaves the limits safe)."""
    ns, tenant = rig["namespace"], rig["tenant"]
    source: dict[str, Any] = {"configMapRef": {"name": "settings"}}
    if prefix is not None:
        source["prefix"] = prefix
    body = builders.pod("from", builders.container("app", gpu=1 if gpu else None, envFrom=[source]))
    pods = f"/api/v1/namespaces/{ns}/pods"
    if not refused:
        await tenant.request("POST", pods, body=body)
        return
    message = await _refused(tenant, "POST", pods, body)
    assert f"container app takes env from a source with prefix {prefix}" in message


@pytest.mark.parametrize(
    ("entry", "refused"),
    [
        pytest.param({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, True, id="all"),
        pytest.param({"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-0"}, True, id="a-uuid"),
        pytest.param({"name": "NVIDIA_VISIBLE_DEVICES", "value": ""}, True, id="empty"),
        pytest.param(
            {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}},
            True,
            id="value-from",
        ),
        pytest.param({"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}, False, id="none"),
    ],
)
@pytest.mark.parametrize("kind", ["containers", "initContainers"])
async def test_no_pod_chooses_the_gpus_the_nvidia_runtime_hands_it(
    rig: dict[str, Any], entry: dict[str, Any], refused: bool, kind: str
) -> None:
    """A pod asking no GPU at all, so the webhook never sees it: under the NVIDIA container
    toolkit's default, NVIDIA_VISIBLE_DEVICES=all would give it every GPU of its node."""
    ns, tenant = rig["namespace"], rig["tenant"]
    sneaky = {**builders.container("sneaky"), "env": [entry]}
    body = (
        builders.pod("visible", sneaky)
        if kind == "containers"
        else builders.pod("visible", builders.container(), init=[sneaky])
    )
    pods = f"/api/v1/namespaces/{ns}/pods"
    if not refused:
        created = await tenant.request("POST", pods, body=body)
        assert created["spec"][kind][0]["env"] == [entry]
        return
    message = await _refused(tenant, "POST", pods, body)
    assert "container sneaky sets NVIDIA_VISIBLE_DEVICES" in message


async def test_an_ephemeral_container_cannot_choose_gpus_either(rig: dict[str, Any]) -> None:
    ns, editor = rig["namespace"], rig["editor"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    await editor.request("POST", pods, body=builders.pod("debugged", builders.container()))

    def debug(name: str, env: dict[str, str] | None) -> dict[str, Any]:
        ephemeral: dict[str, Any] = {"name": name, "image": builders.IMAGE}
        if env is not None:
            ephemeral["env"] = [{"name": k, "value": v} for k, v in env.items()]
        return {"spec": {"ephemeralContainers": [ephemeral]}}

    message = await _refused(
        editor,
        "PATCH",
        f"{pods}/debugged/ephemeralcontainers",
        debug("shell", {"NVIDIA_VISIBLE_DEVICES": "all"}),
        patch=True,
    )
    assert "container shell sets NVIDIA_VISIBLE_DEVICES" in message
    done = await editor.request(
        "PATCH",
        f"{pods}/debugged/ephemeralcontainers",
        body=debug("plain-shell", None),
        content_type=MERGE_PATCH,
    )
    assert [c["name"] for c in done["spec"]["ephemeralContainers"]] == ["plain-shell"]


async def test_a_gpu_container_cannot_cover_the_device_plugins_mounts(rig: dict[str, Any]) -> None:
    """The webhook is down: the policy alone refuses each, naming the pod, container, volume and path."""
    ns, tenant = rig["namespace"], rig["tenant"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    wrong = []
    for case, path, source, sub_path in COVERING_MOUNTS:
        for init in (False, True):
            name = f"cover-{case}{'-init' if init else ''}"
            answer = await _answer(tenant, pods, mounting_pod(name, path, source, sub_path, init=init))
            if (
                not answer.startswith("403")
                or f"pod {name}: container cuda mounts volume mine at {path}:" not in answer
            ):
                wrong.append(f"{case}{' (init)' if init else ''}: {answer}")
    assert wrong == [], "GPU pods covering the device plugin's mounts, not refused for it"


async def test_volumes_elsewhere_and_in_containers_asking_no_gpu_are_admitted(rig: dict[str, Any]) -> None:
    """Beside a reserved path (a sibling, a name it starts) is no cover, and a container asking no
    GPU gets none of the device plugin's mounts to cover."""
    ns, tenant = rig["namespace"], rig["tenant"]
    pods = f"/api/v1/namespaces/{ns}/pods"
    for name, body in (
        ("etc2", mounting_pod("etc2", "/etc2")),
        ("data", mounting_pod("data", "/data")),
        ("vgpu2", mounting_pod("vgpu2", "/usr/local/vgpu2")),
        ("no-gpu", mounting_pod("no-gpu", "/etc/ld.so.preload", gpu=False)),
        ("no-gpu-limits", mounting_pod("no-gpu-limits", "/usr/local/vgpu/limits", gpu=False)),
    ):
        created = await tenant.request("POST", pods, body=body)
        assert created["metadata"]["name"] == name


async def test_the_mount_policy_reserves_the_hook_paths_it_is_given(kube_client: Any, namespace: str) -> None:
    admin = RawKube(kube_client)
    policies = Policies(
        admin,
        [namespace],
        "hami-py.io/none",
        schedulers=[],
        device_plugins=[],
        hook_paths=["/opt/hami/vgpu", "/srv/vgpu"],
    )
    pods = f"/api/v1/namespaces/{namespace}/pods"
    try:
        await policies.install()
        for path in ("/opt/hami/vgpu/limits", "/srv/vgpu", "/etc/ld.so.preload", "/opt", "/opt/hami", "/srv"):
            message = await _refused(admin, "POST", pods, mounting_pod("cover", path))
            assert f"mounts volume mine at {path}:" in message
        await admin.request("POST", pods, body=mounting_pod("default-hook", "/usr/local/vgpu/limits"))
        await admin.request("POST", pods, body=mounting_pod("usr-local", "/usr/local"))
    finally:
        await policies.remove()


async def test_exempt_namespaces_may_set_nvidia_visible_devices_and_nothing_else(kube_client: Any) -> None:
    """The chart's own DaemonSets (device plugin, monitor) take NVML through the NVIDIA runtime with
    NVIDIA_VISIBLE_DEVICES=all: pods of their namespace may set it, by env or by prefix, and nothing
    else the policies refuse."""
    admin = RawKube(kube_client)
    system, other = await create_namespace(kube_client, prefix="sys"), await create_namespace(kube_client)
    policies = Policies(
        admin,
        [system, other],
        "hami-py.io/none",
        schedulers=[],
        device_plugins=[],
        exempt_namespaces=[system],
    )
    pods = f"/api/v1/namespaces/{system}/pods"
    try:
        await policies.install(probe_namespace=other)
        visible = builders.pod("agent", builders.container(env={"NVIDIA_VISIBLE_DEVICES": "all"}))
        await admin.request("POST", pods, body=visible)
        await _refused(admin, "POST", f"/api/v1/namespaces/{other}/pods", visible)
        from_source = builders.container(envFrom=[{"prefix": "NVIDIA_", "configMapRef": {"name": "gpus"}}])
        await admin.request("POST", pods, body=builders.pod("agent-from", from_source))
        # Everything else is refused there as anywhere: a GPU container's limits and interposer
        # switches (by env and by prefix), its mounts, a GPU pod placed on a node.
        for name, limit in (("limit", "CUDA_DEVICE_MEMORY_LIMIT"), ("preload", "LD_PRELOAD")):
            greedy = builders.pod(name, builders.container("cuda", gpu=1, env={limit: "1"}))
            assert f"container cuda sets {limit}" in await _refused(admin, "POST", pods, greedy)
        prefixed = builders.container(
            "cuda", gpu=1, envFrom=[{"prefix": "CUDA_", "configMapRef": {"name": "limits"}}]
        )
        message = await _refused(admin, "POST", pods, builders.pod("prefixed", prefixed))
        assert "container cuda takes env from a source with prefix CUDA_" in message
        covering = mounting_pod("covering", LD_SO_PRELOAD)
        assert f"mounts volume mine at {LD_SO_PRELOAD}:" in await _refused(admin, "POST", pods, covering)
        pinned = builders.pod("pinned", builders.container(gpu=1), node_name="somewhere")
        assert "spec.nodeName" in await _refused(admin, "POST", pods, pinned)
    finally:
        await policies.remove()
        for namespace in (system, other):
            await delete_namespace(kube_client, namespace)


async def test_the_policies_type_check_against_the_pod_schema(kube_client: Any) -> None:
    """The API server type-checks each policy's validations against the Pod and Node schemas and
    reports a field it does not know (which would be an error at admission, refusing every pod it
    matches). Variables are not checked there: the pods admitted in the tests above show theirs."""
    admin = RawKube(kube_client)
    policies = Policies(admin, ["none"], "hami-py.io/none", schedulers=["s"], device_plugins=["p"])
    try:
        await policies.install(probe_namespace=None, wait=False)
        for name in policies.policy_names():

            async def checked(name: str = name) -> dict[str, Any] | None:
                found = await admin.request("GET", f"{ADMISSION}/validatingadmissionpolicies/{name}")
                status: dict[str, Any] = found.get("status") or {}
                return status if "typeChecking" in status else None

            status = await wait_for(checked, timeout=30, what=f"policy {name} type-checked")
            assert status["typeChecking"].get("expressionWarnings") in (None, []), status
    finally:
        await policies.remove()
