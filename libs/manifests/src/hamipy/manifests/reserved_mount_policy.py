"""The admission policy that keeps a GPU container's own volumes off the device plugin's mounts.

The paths and why they are reserved are ``hamipy.protocol.reserved_mounts``'s; this is the same rule
in CEL, test for test, for the API server, so that it holds while the webhook is down: a container
or init container asking for the GPU count resource (limits or requests) may not have a
``volumeMounts`` entry at, under or above a hook path or ``/etc/ld.so.preload``, nor at a path
that is not canonical. At a pod's CREATE only: volume mounts never change afterwards, and ephemeral containers
ask for no resources, so they get none of the device plugin's mounts to cover.

No namespace is exempt: no pod of ours is a GPU container, so none needs a volume there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from hamipy.manifests.policy_objects import asks_count, binding, policy, rule
from hamipy.protocol.allocation_env import LD_SO_PRELOAD
from hamipy.protocol.cel import cel_string
from hamipy.protocol.reserved_mounts import (
    HOOK_REASON,
    NOT_CANONICAL_ENDS,
    NOT_CANONICAL_PARTS,
    NOT_CANONICAL_REASON,
    PARENT_REASON,
    PRELOAD_REASON,
    folder,
    reserved_mount_paths,
)
from hamipy.protocol.resources import ResourceNames

__all__ = ["MOUNT_POLICY_NAME", "reserved_mount_policy"]

MOUNT_POLICY_NAME: Final = "reserved-mounts"


def _why(reserved: Sequence[str]) -> str:
    """CEL: for ``m.mountPath``, the reason it is refused (``reserved_mount_why``), or ``''``."""
    path = "m.mountPath"
    canonical = " && ".join(
        [
            f"{path}.startsWith('/')",
            *(f"!{path}.contains({cel_string(part)})" for part in NOT_CANONICAL_PARTS),
            *(f"!{path}.endsWith({cel_string(end)})" for end in NOT_CANONICAL_ENDS),
        ]
    )
    why = f"({canonical}) ? '' : {cel_string(NOT_CANONICAL_REASON)}"
    as_folder = f"({path}.endsWith('/') ? {path} : {path} + '/')"  # folder(m.mountPath)
    parent = " || ".join(f"{cel_string(folder(p))}.startsWith({as_folder})" for p in reserved)
    why = f"({parent}) ? {cel_string(PARENT_REASON)} : ({why})"
    for reserved_path in reversed(reserved):
        reason = PRELOAD_REASON if reserved_path == LD_SO_PRELOAD else HOOK_REASON
        covered = (
            f"{path} == {cel_string(reserved_path)} || {path}.startsWith({cel_string(folder(reserved_path))})"
        )
        why = f"({covered}) ? {cel_string(reason)} : ({why})"
    return why


def reserved_mount_policy(
    prefix: str, names: ResourceNames, hook_paths: Sequence[str]
) -> list[dict[str, Any]]:
    """The policy and its binding (``admissionregistration.k8s.io/v1``); ``names``: our resource
    names (the count decides what a GPU container is); ``hook_paths``: every hook path the cluster's
    device plugins mount the interposer at."""
    name = prefix + MOUNT_POLICY_NAME
    why = _why(reserved_mount_paths(hook_paths))
    mounts = (
        f"c.volumeMounts.filter(m, ({why}) != '')"
        f".map(m, 'container ' + c.name + ' mounts volume ' + m.name + ' at ' + m.mountPath + ': ' + ({why}))"
    )
    variables = [
        {
            "name": "gpuContainers",
            "expression": (
                "(object.spec.containers + "
                "(has(object.spec.initContainers) ? object.spec.initContainers : []))"
                f".filter(c, {asks_count(names)})"
            ),
        },
        {
            # Per GPU container with volume mounts, its refusals; only the non-empty lists.
            "name": "covering",
            "expression": (
                f"variables.gpuContainers.map(c, has(c.volumeMounts) ? {mounts} : [])"
                ".filter(found, size(found) > 0)"
            ),
        },
    ]
    # Fail closed (the default): a pod this cannot read might be covering the limits.
    mount_policy = policy(
        name,
        [rule("pods", "CREATE")],
        {
            "variables": variables,
            "validations": [
                {
                    "expression": "size(variables.covering) == 0",
                    "messageExpression": "'pod ' + object.metadata.name + ': ' + variables.covering[0][0]",
                    "reason": "Forbidden",
                }
            ],
        },
    )
    return [mount_policy, binding(name)]
