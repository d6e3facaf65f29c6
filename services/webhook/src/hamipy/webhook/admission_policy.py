"""The ValidatingAdmissionPolicies that keep GPU allocation state in the system's hands.

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

Built here once; the chart's ``admission-policy.yaml`` is checked against it by a unit test, and
``hamipy-webhook manifest --policy`` prints it for the dev cluster and for other installs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from hamipy.protocol import keys
from hamipy.webhook.quota_policy import quota_policy

__all__ = [
    "DEFAULT_PREFIX",
    "DEVICE_PLUGINS_PLACEHOLDER",
    "NODE_NAME_CLAIM",
    "NODE_POLICY_NAME",
    "POD_POLICY_NAME",
    "PREFIX_PLACEHOLDER",
    "SCHEDULERS_PLACEHOLDER",
    "admission_policies",
    "chart_file",
    "service_account_user",
]

DEFAULT_PREFIX: Final = "hamipy-"
POD_POLICY_NAME: Final = "allocation-state"
NODE_POLICY_NAME: Final = "device-plugin-node"
"""The policies' names after the prefix (``hamipy-`` here, the release's full name in the chart)."""
NODE_NAME_CLAIM: Final = "authentication.kubernetes.io/node-name"
"""The user-info extra the API server adds for a token bound to a node, or to a pod on one."""


def service_account_user(namespace: str, name: str) -> str:
    """The user name Kubernetes gives a ServiceAccount's tokens."""
    return f"system:serviceaccount:{namespace}:{name}"


def _cel_list(items: Sequence[str]) -> str:
    return json.dumps(list(items)).replace('"', "'")


def _changed(field: str, names: Sequence[str]) -> str:
    """CEL: the keys of ``names`` this request sets, changes or removes in ``metadata.<field>``."""
    new = f"has(object.metadata.{field}) && k in object.metadata.{field}"
    old = (
        f"request.operation == 'UPDATE' && has(oldObject.metadata.{field}) && k in oldObject.metadata.{field}"
    )
    return (
        f"{_cel_list(names)}.filter(k, ({new}) != ({old}) || "
        f"(({new}) && object.metadata.{field}[k] != oldObject.metadata.{field}[k]))"
    )


def _binding(policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy, "labels": {"app.kubernetes.io/name": "hami-py"}},
        "spec": {"policyName": policy, "validationActions": ["Deny"]},
    }


def _policy(name: str, resource: str, operations: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "hami-py"}},
        "spec": {
            # A CEL error refuses: the policy guards the allocation chain, it fails closed.
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": operations,
                        "resources": [resource],
                    }
                ]
            },
            **spec,
        },
    }


def admission_policies(
    *, schedulers: Sequence[str], device_plugins: Sequence[str], prefix: str = DEFAULT_PREFIX
) -> list[dict[str, Any]]:
    """The three policies and their bindings (``admissionregistration.k8s.io/v1``), JSON-ready: the
    two below and ``gpu-quota`` (``hamipy.webhook.quota_policy``).

    ``schedulers``: the user names that may write all allocation state (our extender's service
    account; add HAMi's scheduler when it runs beside ours). ``device_plugins``: those that may
    write the device plugin's keys on their own node's pods, and update only their own node.
    """
    node_claim = (
        f"'{NODE_NAME_CLAIM}' in request.userInfo.extra && "
        f"size(request.userInfo.extra['{NODE_NAME_CLAIM}']) == 1 ? "
        f"request.userInfo.extra['{NODE_NAME_CLAIM}'][0] : ''"
    )
    writer = (
        f"request.userInfo.username in {_cel_list(schedulers)} ? 'scheduler' : "
        f"(request.userInfo.username in {_cel_list(device_plugins)} ? 'device-plugin' : 'other')"
    )
    changed = "variables.changedAnnotations + variables.changedLabels"
    plugin_keys = _cel_list(keys.PLUGIN_WRITTEN_ANNOTATIONS)
    pod_policy = _policy(
        prefix + POD_POLICY_NAME,
        "pods",
        ["CREATE", "UPDATE"],
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
    node_policy = _policy(
        prefix + NODE_POLICY_NAME,
        "nodes",
        ["UPDATE"],
        {
            "matchConditions": [
                {
                    "name": "is-a-device-plugin",
                    "expression": f"request.userInfo.username in {_cel_list(device_plugins)}",
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
    return [
        pod_policy,
        _binding(prefix + POD_POLICY_NAME),
        node_policy,
        _binding(prefix + NODE_POLICY_NAME),
        *quota_policy(prefix),
    ]


PREFIX_PLACEHOLDER: Final = "@PREFIX@"
SCHEDULERS_PLACEHOLDER: Final = "@SCHEDULERS@"
DEVICE_PLUGINS_PLACEHOLDER: Final = "@DEVICE_PLUGINS@"
CHART_FILE_HEADER: Final = """\
# The admission policies of hami-py (hamipy.webhook.admission_policy). Generated: do not edit.
# Regenerate: python -m hamipy.webhook.admission_policy > deploy/helm/hami-py/files/admission-policies.yaml
# The chart's admission-policy.yaml puts in its names and user names for the placeholders; a unit
# test checks this file against the code.
"""


def chart_file() -> str:
    """The policies as the chart ships them: JSON documents with the user lists as placeholders."""
    docs = admission_policies(
        schedulers=[SCHEDULERS_PLACEHOLDER],
        device_plugins=[DEVICE_PLUGINS_PLACEHOLDER],
        prefix=PREFIX_PLACEHOLDER,
    )
    return CHART_FILE_HEADER + "".join(f"---\n{json.dumps(doc, indent=2)}\n" for doc in docs)


if __name__ == "__main__":
    import sys

    sys.stdout.write(chart_file())
