"""The admission policy that refuses a pod the ``cdi.k8s.io/`` annotations.

The prefix and why it is reserved are ``hamipy.protocol.reserved_annotations``'s; this is the rule
in CEL, for the API server, so that it holds for every pod, GPU or not (a pod asking no GPU could
name a whole GPU through them), and while the webhook is down: a pod is not created with a
``cdi.k8s.io/`` annotation, and no update sets or changes one (a pod's annotations may change
while it waits for its node, before the runtime reads them). An update that keeps one as it was,
or removes it, passes: a pod created before the policy is not stuck. No namespace is exempt: no
component of ours takes CDI devices through pod annotations.
"""

from __future__ import annotations

from typing import Any, Final

from hamipy.manifests.policy_objects import binding, policy, rule
from hamipy.protocol.cel import cel_string
from hamipy.protocol.reserved_annotations import CDI_ANNOTATION_PREFIX, CDI_RESERVED_REASON

__all__ = ["ANNOTATION_POLICY_NAME", "reserved_annotation_policy"]

ANNOTATION_POLICY_NAME: Final = "reserved-annotations"


def reserved_annotation_policy(prefix: str) -> list[dict[str, Any]]:
    """The policy and its binding (``admissionregistration.k8s.io/v1``)."""
    name = prefix + ANNOTATION_POLICY_NAME
    kept = (
        "request.operation == 'UPDATE' && has(oldObject.metadata.annotations) && "
        "k in oldObject.metadata.annotations && "
        "oldObject.metadata.annotations[k] == object.metadata.annotations[k]"
    )
    variables = [
        {
            # The reserved keys this request sets or changes (a map's macros range over its keys).
            "name": "reserved",
            "expression": (
                "has(object.metadata.annotations) ? object.metadata.annotations.filter(k, "
                f"k.startsWith({cel_string(CDI_ANNOTATION_PREFIX)}) && !({kept})) : []"
            ),
        },
    ]
    # Fail closed (the default): a pod this cannot read might be naming devices.
    annotation_policy = policy(
        name,
        [rule("pods", "CREATE", "UPDATE")],
        {
            "variables": variables,
            "validations": [
                {
                    "expression": "size(variables.reserved) == 0",
                    "messageExpression": (
                        "'pod ' + object.metadata.name + ': annotation ' + variables.reserved[0] + "
                        f"{cel_string(': ' + CDI_RESERVED_REASON)}"
                    ),
                    "reason": "Forbidden",
                }
            ],
        },
    )
    return [annotation_policy, binding(name)]
