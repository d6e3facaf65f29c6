"""The admission policy that refuses a pod its namespace's GPU quota could never admit.

The extender enforces ``limits.nvidia.com/gpumem`` and ``limits.nvidia.com/gpucores`` at placement
(docs/configuration.md#gpu-quotas): a pod over its quota waits, Pending, until the quota has room.
A pod whose ask alone is over a limit would wait forever, so it is refused at creation, as HAMi's
webhook does, naming the quota: a ValidatingAdmissionPolicy whose parameters are the ResourceQuotas
of the pod's own namespace (the binding's ``paramRef`` has no namespace), evaluated once per quota.

The charge here is a lower bound of what the extender will charge: fixed MiB x GPUs per container,
the app containers summed against the largest init container (sidecars count as app containers
only in the extender, so leaving them out can only lower it). A percentage (or no memory, the whole
GPU) depends on the GPU chosen and is charged 0 here; the extender checks it. The policy runs after
the webhook's mutation, so the counts the webhook adds are seen.

``failurePolicy: Ignore``: a quota value that CEL cannot read must not refuse every pod of the
namespace (the extender reports such a quota and does not enforce that limit either).
"""

from __future__ import annotations

from typing import Any, Final

from hamipy.manifests.policy_objects import binding, policy, rule
from hamipy.protocol.resources import ResourceNames

__all__ = ["QUOTA_POLICY_NAME", "quota_policy"]

QUOTA_POLICY_NAME: Final = "gpu-quota"


def _ask(container: str, resource: str) -> str:
    """CEL: the container's ``resource`` as an integer (limits, else requests, else 0)."""

    def read(field: str) -> str:
        path = f"{container}.resources.{field}"
        return f"has({container}.resources) && has({path}) && '{resource}' in {path}"

    return (
        f"({read('limits')} ? quantity({container}.resources.limits['{resource}']).asInteger() : "
        f"({read('requests')} ? quantity({container}.resources.requests['{resource}']).asInteger() : 0))"
    )


def _charge(names: ResourceNames, per_gpu: str) -> str:
    """CEL: max(sum over app containers, largest init container) of count x ``per_gpu``."""
    one = f"{_ask('c', names.count)} * {_ask('c', per_gpu)}"
    apps = f"object.spec.containers.map(c, {one}).sum()"
    inits = f"object.spec.initContainers.map(c, {one})"
    return (
        f"has(object.spec.initContainers) && size(object.spec.initContainers) > 0 && {inits}.max() > {apps} "
        f"? {inits}.max() : {apps}"
    )


def quota_policy(prefix: str, names: ResourceNames | None = None) -> list[dict[str, Any]]:
    """The policy and its binding (``admissionregistration.k8s.io/v1``)."""
    names = names or ResourceNames()
    name = prefix + QUOTA_POLICY_NAME
    checks = []
    memory_key, cores_key = names.quota_keys
    for resource, key, unit, variable in (
        (names.memory, memory_key, "MiB", "memory"),
        (names.cores, cores_key, "percent", "cores"),
    ):
        checks.append(
            {
                "expression": (
                    f"!('{key}' in params.spec.hard) || "
                    f"variables.{variable} <= quantity(params.spec.hard['{key}']).asInteger()"
                ),
                "messageExpression": (
                    f"'pod ' + object.metadata.name + ' asks ' + string(variables.{variable}) + "
                    f"' {unit} of {resource} over its GPUs, more than ResourceQuota ' + "
                    f"params.metadata.name + ' allows namespace ' + params.metadata.namespace + "
                    f"' in all ({key}: ' + params.spec.hard['{key}'] + '): it could never be scheduled'"
                ),
                "reason": "Forbidden",
            }
        )
    quota = policy(
        name,
        [rule("pods", "CREATE")],
        {
            "paramKind": {"apiVersion": "v1", "kind": "ResourceQuota"},
            "variables": [
                {"name": "memory", "expression": _charge(names, names.memory)},
                {"name": "cores", "expression": _charge(names, names.cores)},
            ],
            "validations": checks,
        },
        failure_policy="Ignore",
    )
    # Every ResourceQuota of the pod's own namespace; a namespace without one admits.
    return [quota, binding(name, paramRef={"selector": {}, "parameterNotFoundAction": "Allow"})]
