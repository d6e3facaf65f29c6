"""The ValidatingAdmissionPolicies that keep GPU allocation state and placement in the system's hands.

A pod's allocation annotations (``keys.ALLOCATION_STATE_ANNOTATIONS``: the node, the devices to
allocate and allocated, the bind phase and time) and the ``hami.io/vgpu-node`` label tell the device
plugin which GPU slice a container gets. A tenant who could write them could give themselves any
slice, or take a waiting pod's. So, in the API server, where it holds while the webhook is down:

- ``allocation-state`` (pods, CREATE and UPDATE, every pod, GPU or not): only the extender's
  identities set or change those keys; the device plugin's only ``keys.PLUGIN_WRITTEN_ANNOTATIONS``
  and only on pods bound to its own node (the ``authentication.kubernetes.io/node-name`` claim of a
  node- or pod-bound service account token); anyone else's create or update that sets, changes or
  removes one is refused with the key and the rule.
- ``device-plugin-node`` (nodes, UPDATE by a device plugin identity): a device plugin updates
  only the node its token is bound to, as NodeRestriction holds kubelets to theirs.
- ``gpu-pod-placement`` (pods, CREATE, pods naming one of our GPU resources): only the extender's
  identities create a GPU pod with ``spec.nodeName`` already set. Anyone else's would reach the
  kubelet without our scheduler choosing its GPUs (its own scheduler, or none at all).

And four more, built beside: ``reserved-env`` (``reserved_env_policy``: the env a pod
may not set), ``reserved-mounts`` (``reserved_mount_policy``: the paths a GPU
container's own volumes may not cover), ``reserved-annotations``
(``reserved_annotation_policy``: the CDI annotations a pod may not carry) and
``gpu-quota`` (``quota_policy``).

Built here once; the chart's ``admission-policy.yaml`` is checked against it by a unit test, and
``hamipy-webhook manifest --policy`` prints it for the dev cluster and for other installs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from hamipy.manifests.policy_objects import binding, policy, rule
from hamipy.manifests.quota_policy import quota_policy
from hamipy.manifests.reserved_annotation_policy import ANNOTATION_POLICY_NAME, reserved_annotation_policy
from hamipy.manifests.reserved_env_policy import ENV_POLICY_NAME, reserved_env_policy
from hamipy.manifests.reserved_mount_policy import MOUNT_POLICY_NAME, reserved_mount_policy
from hamipy.protocol import keys
from hamipy.protocol.allocation_env import DEFAULT_HOOK_PATH
from hamipy.protocol.cel import cel_list, gpu_pod_expression
from hamipy.protocol.resources import ResourceNames

__all__ = [
    "ANNOTATION_POLICY_NAME",
    "CHART_PLACEHOLDERS",
    "DEFAULT_PREFIX",
    "ENV_POLICY_NAME",
    "MOUNT_POLICY_NAME",
    "NODE_NAME_CLAIM",
    "NODE_POLICY_NAME",
    "PLACEMENT_POLICY_NAME",
    "POD_POLICY_NAME",
    "admission_policies",
    "chart_file",
    "service_account_user",
]

DEFAULT_PREFIX: Final = "hamipy-"
POD_POLICY_NAME: Final = "allocation-state"
NODE_POLICY_NAME: Final = "device-plugin-node"
PLACEMENT_POLICY_NAME: Final = "gpu-pod-placement"
"""The policies' names after the prefix (``hamipy-`` here, the release's full name in the chart)."""
NODE_NAME_CLAIM: Final = "authentication.kubernetes.io/node-name"
"""The user-info extra the API server adds for a token bound to a node, or to a pod on one."""


def service_account_user(namespace: str, name: str) -> str:
    """The user name Kubernetes gives a ServiceAccount's tokens."""
    return f"system:serviceaccount:{namespace}:{name}"


def _changed(field: str, names: Sequence[str]) -> str:
    """CEL: the keys of ``names`` this request sets, changes or removes in ``metadata.<field>``."""
    new = f"has(object.metadata.{field}) && k in object.metadata.{field}"
    old = (
        f"request.operation == 'UPDATE' && has(oldObject.metadata.{field}) && k in oldObject.metadata.{field}"
    )
    return (
        f"{cel_list(names)}.filter(k, ({new}) != ({old}) || "
        f"(({new}) && object.metadata.{field}[k] != oldObject.metadata.{field}[k]))"
    )


def _placement_policy(name: str, schedulers: Sequence[str], names: ResourceNames) -> dict[str, Any]:
    return policy(
        name,
        [rule("pods", "CREATE")],
        {
            "matchConditions": [{"name": "asks-for-hami-gpus", "expression": gpu_pod_expression(names)}],
            "validations": [
                {
                    "expression": (
                        "!has(object.spec.nodeName) || object.spec.nodeName == '' || "
                        f"request.userInfo.username in {cel_list(schedulers)}"
                    ),
                    "messageExpression": (
                        "'pod ' + object.metadata.name + ' asks for hami-py GPUs and sets spec.nodeName (' + "
                        "object.spec.nodeName + '): a GPU pod is placed by the hami-py scheduler, which "
                        "chooses its GPUs; ' + request.userInfo.username + ' may not place one (remove "
                        "spec.nodeName)'"
                    ),
                    "reason": "Forbidden",
                }
            ],
        },
    )


def admission_policies(
    *,
    schedulers: Sequence[str],
    device_plugins: Sequence[str],
    names: ResourceNames | None = None,
    exempt_namespaces: Sequence[str] = (),
    hook_paths: Sequence[str] = (DEFAULT_HOOK_PATH,),
    prefix: str = DEFAULT_PREFIX,
) -> list[dict[str, Any]]:
    """The seven policies and their bindings (``admissionregistration.k8s.io/v1``), JSON-ready: the
    three below, ``reserved-env``, ``reserved-mounts``, ``reserved-annotations`` and ``gpu-quota``.

    ``schedulers``: the user names that may write all allocation state and create GPU pods already
    placed (our extender's service account; add HAMi's scheduler when it runs beside ours).
    ``device_plugins``: those that may write the device plugin's keys on their own node's pods, and
    update only their own node. ``names``: our resource names (the defaults when None).
    ``exempt_namespaces``: namespaces whose pods may set ``NVIDIA_VISIBLE_DEVICES`` (the chart's
    release namespace).
    ``hook_paths``: where the device plugins mount the interposer (``nvidia.hookPath``; more than one
    where nodes differ), kept free of GPU containers' own volumes.
    """
    names = names or ResourceNames()
    node_claim = (
        f"'{NODE_NAME_CLAIM}' in request.userInfo.extra && "
        f"size(request.userInfo.extra['{NODE_NAME_CLAIM}']) == 1 ? "
        f"request.userInfo.extra['{NODE_NAME_CLAIM}'][0] : ''"
    )
    writer = (
        f"request.userInfo.username in {cel_list(schedulers)} ? 'scheduler' : "
        f"(request.userInfo.username in {cel_list(device_plugins)} ? 'device-plugin' : 'other')"
    )
    changed = "variables.changedAnnotations + variables.changedLabels"
    plugin_keys = cel_list(keys.PLUGIN_WRITTEN_ANNOTATIONS)
    pod_policy = policy(
        prefix + POD_POLICY_NAME,
        [rule("pods", "CREATE", "UPDATE")],
        {
            "variables": [
                {"name": "writer", "expression": writer},
                {"name": "nodeName", "expression": node_claim},
                {
                    "name": "changedAnnotations",
                    "expression": _changed("annotations", keys.ALLOCATION_STATE_ANNOTATIONS),
                },
                {"name": "changedLabels", "expression": _changed("labels", keys.ALLOCATION_STATE_LABELS)},
            ],
            "validations": [
                {
                    "expression": (
                        f"size({changed}) == 0 || variables.writer == 'scheduler' || "
                        "(variables.writer == 'device-plugin' && size(variables.changedLabels) == 0 && "
                        f"variables.changedAnnotations.all(k, k in {plugin_keys}))"
                    ),
                    "messageExpression": (
                        f"'pod ' + object.metadata.name + ': ' + ({changed}).join(', ') + "
                        "' carries GPU allocation state, which only the hami-py scheduler sets or changes "
                        "(the device plugin only "
                        f"{', '.join(keys.PLUGIN_WRITTEN_ANNOTATIONS)}); ' + "
                        "request.userInfo.username + ' may not'"
                    ),
                    "reason": "Forbidden",
                },
                {
                    "expression": (
                        f"variables.writer != 'device-plugin' || size({changed}) == 0 || "
                        "(variables.nodeName != '' && has(object.spec.nodeName) && "
                        "object.spec.nodeName == variables.nodeName)"
                    ),
                    "messageExpression": (
                        "'pod ' + object.metadata.name + ': a device plugin changes allocation state only "
                        "on pods bound to its own node (its token is bound to ' + "
                        "(variables.nodeName == '' ? 'no node' : 'node ' + variables.nodeName) + ')'"
                    ),
                    "reason": "Forbidden",
                },
            ],
        },
    )
    node_policy = policy(
        prefix + NODE_POLICY_NAME,
        [rule("nodes", "UPDATE")],
        {
            "matchConditions": [
                {
                    "name": "is-a-device-plugin",
                    "expression": f"request.userInfo.username in {cel_list(device_plugins)}",
                }
            ],
            "variables": [{"name": "nodeName", "expression": node_claim}],
            "validations": [
                {
                    "expression": "variables.nodeName != '' && object.metadata.name == variables.nodeName",
                    "messageExpression": (
                        "'node ' + object.metadata.name + ': a device plugin updates only its own node "
                        "(its token is bound to ' + "
                        "(variables.nodeName == '' ? 'no node' : 'node ' + variables.nodeName) + ')'"
                    ),
                    "reason": "Forbidden",
                }
            ],
        },
    )
    placement = prefix + PLACEMENT_POLICY_NAME
    return [
        pod_policy,
        binding(prefix + POD_POLICY_NAME),
        node_policy,
        binding(prefix + NODE_POLICY_NAME),
        _placement_policy(placement, schedulers, names),
        binding(placement),
        *reserved_env_policy(prefix, names, exempt_namespaces),
        *reserved_mount_policy(prefix, names, hook_paths),
        *reserved_annotation_policy(prefix),
        *quota_policy(prefix, names),
    ]


CHART_PLACEHOLDERS: Final = {
    "prefix": "@PREFIX@",
    "schedulers": "@SCHEDULERS@",
    "device_plugins": "@DEVICE_PLUGINS@",
    "exempt_namespaces": "@EXEMPT_NAMESPACES@",
    "count": "@GPU_COUNT@",
    "memory": "@GPU_MEMORY@",
    "memory_percentage": "@GPU_MEMORY_PERCENTAGE@",
    "cores": "@GPU_CORES@",
    "hook_path": "/@HOOK_PATH@",
}
"""What the chart's admission-policy.yaml replaces in the file: the release's prefix, its lists of
user names and namespaces (each list written as one quoted placeholder), its resource names, and its
hook path (a path itself, so that cleaning it as one keeps it)."""
CHART_FILE_HEADER: Final = """\
# The admission policies of hami-py (hamipy.manifests.admission_policy). Generated: do not edit.
# Regenerate: python -m hamipy.manifests.admission_policy > deploy/helm/hami-py/files/admission-policies.yaml
# The chart's admission-policy.yaml puts in its names, user names, exempt namespaces and resource
# names for the placeholders; a unit test checks this file against the code.
"""


def chart_file() -> str:
    """The policies as the chart ships them: JSON documents with placeholders (``CHART_PLACEHOLDERS``)."""
    p = CHART_PLACEHOLDERS
    docs = admission_policies(
        schedulers=[p["schedulers"]],
        device_plugins=[p["device_plugins"]],
        names=ResourceNames(
            count=p["count"], memory=p["memory"], memory_percentage=p["memory_percentage"], cores=p["cores"]
        ),
        exempt_namespaces=[p["exempt_namespaces"]],
        hook_paths=[p["hook_path"]],
        prefix=p["prefix"],
    )
    return CHART_FILE_HEADER + "".join(f"---\n{json.dumps(doc, indent=2)}\n" for doc in docs)


if __name__ == "__main__":
    import sys

    sys.stdout.write(chart_file())
