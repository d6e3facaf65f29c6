"""The ValidatingAdmissionPolicy and binding objects every admission policy of ours is built from
(``admission_policy``, ``reserved_env_policy``, ``reserved_mount_policy``, ``quota_policy``):
JSON-ready dicts of ``admissionregistration.k8s.io/v1``, labelled as the chart's, and CEL string and
list literals, and the CEL test of a container asking for resources."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final, Literal

__all__ = ["binding", "cel_list", "cel_string", "container_asks", "policy", "rule"]

_API: Final = "admissionregistration.k8s.io/v1"
_LABELS: Final = {"app.kubernetes.io/name": "hami-py"}


def cel_string(text: str) -> str:
    """``text`` as a CEL string literal. What goes in (paths from the configuration, reasons from
    code) needs no escaping: ValueError for text holding ``'`` or ``\\``."""
    if "'" in text or "\\" in text:
        raise ValueError(f"{text!r}: may not hold ' or \\ (it goes into a CEL string)")
    return f"'{text}'"


def cel_list(items: Sequence[str]) -> str:
    """``items`` as a CEL list of string literals (``['a', 'b']``; the chart writes the same form)."""
    return json.dumps(list(items)).replace('"', "'")


def container_asks(var: str, names: Sequence[str]) -> str:
    """CEL: the container ``var`` names one of ``names`` in its limits or requests."""
    wanted = cel_list(names)
    return (
        f"has({var}.resources) && ("
        f"(has({var}.resources.limits) && {wanted}.exists(r, r in {var}.resources.limits)) || "
        f"(has({var}.resources.requests) && {wanted}.exists(r, r in {var}.resources.requests)))"
    )


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
