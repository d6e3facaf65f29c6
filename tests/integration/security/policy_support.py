"""The shipped admission policies, bound to one test's namespaces and nodes only, and the pods that
try to cover the device plugin's mounts, which both security test modules send.

The policies are ``hamipy.manifests.admission_policy``'s; only their names get a suffix and their
bindings a selector, so that the rest of the session (which writes allocation state as admin to
simulate the system, and creates pods anywhere) is not affected. The quota policy has its own test
(test_quota_policy.py): it binds to ResourceQuotas.
"""

from __future__ import annotations

import contextlib
import copy
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Final

import builders

from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.kube.errors import KubeError, NotFound
from hamipy.manifests.admission_policy import (
    ANNOTATION_POLICY_NAME,
    ENV_POLICY_NAME,
    MOUNT_POLICY_NAME,
    NODE_POLICY_NAME,
    PLACEMENT_POLICY_NAME,
    POD_POLICY_NAME,
    admission_policies,
)
from hamipy.manifests.quota_policy import QUOTA_POLICY_NAME
from hamipy.protocol import keys
from hamipy.protocol.allocation_env import LD_SO_PRELOAD

__all__ = ["ADMISSION", "COVERING_MOUNTS", "Policies", "mounting_pod"]

ADMISSION: Final = "/apis/admissionregistration.k8s.io/v1"
_PROBES: Final[Mapping[str, dict[str, Any]]] = {
    POD_POLICY_NAME: builders.pod("probe", builders.container(), annotations={keys.BIND_PHASE: "success"}),
    PLACEMENT_POLICY_NAME: builders.pod("probe", builders.container(gpu=1), node_name="nowhere"),
    ENV_POLICY_NAME: builders.pod("probe", builders.container(env={"NVIDIA_VISIBLE_DEVICES": "all"})),
    MOUNT_POLICY_NAME: builders.pod(
        "probe",
        builders.container(gpu=1, volumeMounts=[{"name": "v", "mountPath": LD_SO_PRELOAD}]),
        volumes=[{"name": "v", "emptyDir": {}}],
    ),
    ANNOTATION_POLICY_NAME: builders.pod(
        "probe", builders.container(), annotations={"cdi.k8s.io/probe": "nvidia.com/gpu=GPU-probe"}
    ),
}
"""For each pod policy, a pod (created as admin) that it refuses: how a test knows it is in force."""


EMPTY: Final[Mapping[str, Any]] = {"emptyDir": {}}
LIMITS_CONFIGMAP: Final[Mapping[str, Any]] = {"configMap": {"name": "my-limits"}}
COVERING_MOUNTS: Final = (
    ("limits", "/usr/local/vgpu/limits", LIMITS_CONFIGMAP, "limits"),
    ("preload", "/etc/ld.so.preload", EMPTY, None),
    ("hook", "/usr/local/vgpu", EMPTY, None),
    ("double-slash", "/usr/local//vgpu", EMPTY, None),
    ("dot", "/etc/./ld.so.preload", EMPTY, None),
    ("dot-dot", "/usr/x/../local/vgpu/limits", LIMITS_CONFIGMAP, "limits"),
    ("relative", "etc/ld.so.preload", EMPTY, None),
    ("root", "/", EMPTY, None),
    ("etc", "/etc", EMPTY, None),
    ("usr", "/usr", EMPTY, None),
    ("usr-local", "/usr/local", EMPTY, None),
)
"""A tenant's volume over the device plugin's mounts (the default hook path): (case, mountPath,
volume source, subPath). The runtime mounts a pod's volumes after the device plugin's at the same
cleaned path, so each would choose the container's limits or leave the interposer out; a volume at
a parent holds what the pod put there, and a link in it could send the device plugin's mount under
another volume of the pod."""


def mounting_pod(
    name: str,
    path: str,
    source: Mapping[str, Any] = EMPTY,
    sub_path: str | None = None,
    *,
    gpu: bool = True,
    init: bool = False,
) -> dict[str, Any]:
    """A pod whose container ``cuda`` (asking a GPU, or none) mounts volume ``mine`` (``source``)
    at ``path``; ``init``: ``cuda`` is an init container, beside a plain one."""
    mount: dict[str, Any] = {"name": "mine", "mountPath": path}
    if sub_path is not None:
        mount["subPath"] = sub_path
    target = builders.container("cuda", gpu=1 if gpu else None, volumeMounts=[mount])
    volumes = [{"name": "mine", **source}]
    if init:
        return builders.pod(name, builders.container(), init=[target], volumes=volumes)
    return builders.pod(name, target, volumes=volumes)


class Policies:
    """The shipped policies (``admission_policies(**options)``, the quota policy left out): the pod
    policies bound to ``namespaces``, the node policy to the nodes labelled ``node_label``."""

    def __init__(self, admin: RawKube, namespaces: Sequence[str], node_label: str, **options: Any) -> None:
        self.admin, self.namespaces, self.node_label = admin, list(namespaces), node_label
        self.docs = [
            d for d in admission_policies(**options) if not d["metadata"]["name"].endswith(QUOTA_POLICY_NAME)
        ]
        self.suffix = secrets.token_hex(3)

    def _named(self, doc: dict[str, Any]) -> dict[str, Any]:
        doc = {**doc, "metadata": {**doc["metadata"], "name": f"{doc['metadata']['name']}-{self.suffix}"}}
        if doc["kind"] == "ValidatingAdmissionPolicyBinding":
            spec = dict(doc["spec"], policyName=f"{doc['spec']['policyName']}-{self.suffix}")
            if doc["spec"]["policyName"].endswith(NODE_POLICY_NAME):
                spec["matchResources"] = {"objectSelector": {"matchLabels": {self.node_label: "true"}}}
            else:
                names = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": self.namespaces}
                spec["matchResources"] = {"namespaceSelector": {"matchExpressions": [names]}}
            doc["spec"] = spec
        return doc

    @staticmethod
    def _path(doc: dict[str, Any]) -> str:
        plural = (
            "validatingadmissionpolicybindings"
            if doc["kind"].endswith("Binding")
            else "validatingadmissionpolicies"
        )
        return f"{ADMISSION}/{plural}"

    def policy_names(self) -> list[str]:
        """The names the policies are created under."""
        return [
            self._named(d)["metadata"]["name"] for d in self.docs if d["kind"] == "ValidatingAdmissionPolicy"
        ]

    async def install(self, *, probe_namespace: str | None = None, wait: bool = True) -> None:
        """Create the policies and (``wait``) wait until each pod policy refuses its probe in
        ``probe_namespace`` (the first namespace by default)."""
        for doc in map(self._named, self.docs):
            await self.admin.request("POST", self._path(doc), body=doc)
        if not wait:
            return
        namespace = probe_namespace or self.namespaces[0]
        pods = f"/api/v1/namespaces/{namespace}/pods"
        # The API server reads policies through an informer: wait until each one refuses.
        for doc in self.docs:
            name = doc["metadata"]["name"]
            policy = next((p for p in _PROBES if name.endswith(p)), None)
            if doc["kind"] != "ValidatingAdmissionPolicy" or policy is None:
                continue
            probe = copy.deepcopy(_PROBES[policy])
            probe["metadata"]["name"] = f"probe-{self.suffix}"

            async def refuses(probe: dict[str, Any] = probe) -> bool:
                try:
                    await self.admin.request("POST", pods, body=probe)
                except KubeError as exc:
                    return exc.status == 403
                await self.admin.request("DELETE", f"{pods}/{probe['metadata']['name']}")
                return False

            await wait_for(refuses, timeout=30, what=f"the admission policy {name} in force")

    async def remove(self) -> None:
        for doc in reversed([self._named(d) for d in self.docs]):
            with contextlib.suppress(NotFound):
                await self.admin.request("DELETE", f"{self._path(doc)}/{doc['metadata']['name']}")
