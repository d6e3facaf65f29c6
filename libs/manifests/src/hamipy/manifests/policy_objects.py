"""The ValidatingAdmissionPolicy and binding objects every admission policy of ours is built from
(``admission_policy``, ``reserved_env_policy``, ``reserved_mount_policy``, ``quota_policy``):
JSON-ready dicts of ``admissionregistration.k8s.io/v1``, labelled as the chart's, and the CEL test of
a GPU container. The CEL literals are ``hamipy.protocol.cel``'s."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

from hamipy.protocol.cel import container_asks
from hamipy.protocol.resources import ResourceNames

__all__ = ["asks_count", "binding", "policy", "rule"]

_API: Final = "admissionregistration.k8s.io/v1"
_LABELS: Final = {"app.kubernetes.io/name": "hami-py"}


def asks_count(names: ResourceNames) -> str:
    """CEL: container ``c`` asks for the GPU count resource (limits or requests): a GPU container,
    the one the device plugin's Allocate answer goes to."""
    return container_asks("c", [names.count])


def rule(resource: str, *operations: str) -> dict[str, Any]:
    """A resource rule on a core/v1 ``resource`` (``pods``, ``pods/ephemeralcontainers``)."""
    return {"apiGroups": [""], "apiVersions": ["v1"], "operations": list(operations), "resources": [resource]}


def policy(
    name: str,
    rules: Sequence[dict[str, Any]],
    spec: dict[str, Any],
    *,
    failure_policy: Literal["Fail", "Ignore"] = "Fail",
) -> dict[str, Any]:
    """The policy ``name`` matching ``rules``, with the rest of its ``spec`` (variables,
    validations, ...). ``Fail`` by default: an expression that cannot be evaluated refuses."""
    return {
        "apiVersion": _API,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": dict(_LABELS)},
        "spec": {"failurePolicy": failure_policy, "matchConstraints": {"resourceRules": list(rules)}, **spec},
    }


def binding(name: str, **spec: Any) -> dict[str, Any]:
    """The binding of policy ``name``, of the same name, refusing (``Deny``); ``spec``: more of it
    (``paramRef``)."""
    return {
        "apiVersion": _API,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": dict(_LABELS)},
        "spec": {"policyName": name, "validationActions": ["Deny"], **spec},
    }
