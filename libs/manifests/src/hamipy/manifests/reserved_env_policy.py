"""The admission policy that refuses a pod the env the device plugin reserves for itself.

The names and why they are reserved are ``hamipy.protocol.reserved_env``'s; this is the same rule in
CEL, for the API server, so that it holds for every pod, GPU or not, and while the webhook is down:

- a container or init container asking for the GPU count resource (limits or requests) may not set
  a ``GPU_CONTAINER_NAMES`` variable or a per-device limit in ``env``, nor take ``envFrom`` with a
  prefix such a name starts with;
- no container, init container or ephemeral container (``pods/ephemeralcontainers``) sets
  ``NVIDIA_VISIBLE_DEVICES`` to anything but ``none``, by ``env`` or by a prefix it starts with.

Pods of the exempt namespaces may set ``NVIDIA_VISIBLE_DEVICES``, and nothing else reserved: the
chart's own DaemonSets take NVML through the NVIDIA runtime with ``NVIDIA_VISIBLE_DEVICES=all``, and
none of them is a GPU container. On a pod's CREATE every container is checked; on an
ephemeral-container update only the ephemeral ones (the others cannot change).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from hamipy.manifests.policy_objects import asks_count, binding, policy, rule
from hamipy.protocol.allocation_env import ENV_VISIBLE_DEVICES
from hamipy.protocol.cel import cel_list
from hamipy.protocol.reserved_env import (
    GPU_CONTAINER_NAMES,
    GPU_RESERVED_REASON,
    PER_DEVICE_PATTERN,
    PER_DEVICE_PREFIX_PATTERN,
    VISIBLE_NONE,
    VISIBLE_RESERVED_REASON,
)
from hamipy.protocol.resources import ResourceNames

__all__ = ["ENV_POLICY_NAME", "reserved_env_policy"]

ENV_POLICY_NAME: Final = "reserved-env"


def _findings(containers: str, per_entry: str, field: str) -> str:
    """CEL: for each of ``containers`` with ``field``, the sentences ``per_entry`` makes of its
    entries (a ``filter(...).map(...)`` over ``x``, naming the container ``c``); only the non-empty
    lists, so ``size(...) == 0`` means none was found and ``[0][0]`` is the first."""
    return f"{containers}.map(c, has(c.{field}) ? c.{field}.{per_entry} : []).filter(found, size(found) > 0)"


def _unless_exempt(per_entry: str, field: str, ephemeral: str) -> str:
    """CEL: ``_findings`` over the app and init containers and the ephemeral ones, none in an
    exempt namespace."""
    return (
        "variables.exempt ? [] : ("
        + _findings("variables.containers", per_entry, field)
        + " + "
        + _findings(ephemeral, per_entry, field)
        + ")"
    )


def reserved_env_policy(
    prefix: str, names: ResourceNames, exempt_namespaces: Sequence[str]
) -> list[dict[str, Any]]:
    """The policy and its binding (``admissionregistration.k8s.io/v1``); ``names``: our resource
    names (the count decides what a GPU container is); ``exempt_namespaces``: where pods may set
    ``NVIDIA_VISIBLE_DEVICES``."""
    name = prefix + ENV_POLICY_NAME
    reserved = cel_list(GPU_CONTAINER_NAMES)
    gpu_name = f"x.name in {reserved} || x.name.matches('{PER_DEVICE_PATTERN}')"
    gpu_prefix = (
        f"has(x.prefix) && x.prefix != '' && ({reserved}.exists(n, n.startsWith(x.prefix)) || "
        f"x.prefix.matches('{PER_DEVICE_PREFIX_PATTERN}'))"
    )
    visible = f"x.name == '{ENV_VISIBLE_DEVICES}' && (!has(x.value) || x.value != '{VISIBLE_NONE}')"
    visible_prefix = f"has(x.prefix) && x.prefix != '' && '{ENV_VISIBLE_DEVICES}'.startsWith(x.prefix)"
    sets = "map(x, 'container ' + c.name + ' sets ' + x.name)"
    takes = "map(x, 'container ' + c.name + ' takes env from a source with prefix ' + x.prefix)"
    ephemeral = "(has(object.spec.ephemeralContainers) ? object.spec.ephemeralContainers : [])"
    variables = [
        {
            # Containers and init containers at a pod's CREATE; none on an ephemeral-container update.
            "name": "containers",
            "expression": (
                "request.operation == 'CREATE' ? object.spec.containers + "
                "(has(object.spec.initContainers) ? object.spec.initContainers : []) : []"
            ),
        },
        {"name": "gpuContainers", "expression": f"variables.containers.filter(c, {asks_count(names)})"},
        {
            "name": "gpuEnv",
            "expression": _findings("variables.gpuContainers", f"filter(x, {gpu_name}).{sets}", "env"),
        },
        {
            "name": "gpuEnvFrom",
            "expression": _findings("variables.gpuContainers", f"filter(x, {gpu_prefix}).{takes}", "envFrom"),
        },
        {"name": "exempt", "expression": f"request.namespace in {cel_list(exempt_namespaces)}"},
        {"name": "visible", "expression": _unless_exempt(f"filter(x, {visible}).{sets}", "env", ephemeral)},
        {
            "name": "visibleFrom",
            "expression": _unless_exempt(f"filter(x, {visible_prefix}).{takes}", "envFrom", ephemeral),
        },
    ]
    checks = [
        ("gpuEnv", f"', {GPU_RESERVED_REASON}'"),
        ("gpuEnvFrom", f"', which could set {GPU_RESERVED_REASON}; use another prefix'"),
        ("visible", f"': {VISIBLE_RESERVED_REASON}'"),
        (
            "visibleFrom",
            f"', which could set {ENV_VISIBLE_DEVICES}: {VISIBLE_RESERVED_REASON}; use another prefix'",
        ),
    ]
    # Fail closed (the default): a pod this cannot read might be setting a limit.
    env_policy = policy(
        name,
        [rule("pods", "CREATE"), rule("pods/ephemeralcontainers", "UPDATE")],
        {
            "variables": variables,
            "validations": [
                {
                    "expression": f"size(variables.{variable}) == 0",
                    "messageExpression": (
                        f"'pod ' + object.metadata.name + ': ' + variables.{variable}[0][0] + {reason}"
                    ),
                    "reason": "Forbidden",
                }
                for variable, reason in checks
            ],
        },
    )
    return [env_policy, binding(name)]
