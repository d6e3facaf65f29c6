"""The fields of Kubernetes objects that hami-py reads from a request body, typed for msgspec.

A service decodes a body once into these records (inside its own request record: the extender's
``ExtenderArgs``, the webhook's ``AdmissionReview``): fields named here must have their JSON type
or be null (null and absent mean the same), anything else is skipped unread, so a field of a newer
Kubernetes costs nothing and a field of the wrong type is a ``msgspec.ValidationError`` naming its
path (``$.Pod.metadata.uid``). Every field is a record or a scalar, never free-form JSON, so the
depth of what is built is bounded by these types; the code that reads a pod as JSON gets the
fields named here through ``plain`` (absent and null fields left out).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "Container",
    "EnvFromSource",
    "EnvVar",
    "Node",
    "ObjectMeta",
    "Pod",
    "PodSpec",
    "Quantity",
    "plain",
]

Quantity = str | int | float | bool
"""A resource quantity as sent: ``hamipy.protocol.quantities`` judges its value (a boolean is
refused there, with the container named)."""


class _Record(msgspec.Struct, rename="camel", omit_defaults=True, frozen=True):
    """Go field names (camelCase); absent and null fields omitted again by ``plain``."""


class ObjectMeta(_Record, frozen=True):
    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    creation_timestamp: str | None = None
    annotations: dict[str, str] | None = None
    labels: dict[str, str] | None = None


class ResourceRequirements(_Record, frozen=True):
    limits: dict[str, Quantity] | None = None
    requests: dict[str, Quantity] | None = None


class EnvVarSource(_Record, frozen=True):
    """Where a variable's value comes from: only whether there is one is read."""


class EnvVar(_Record, frozen=True):
    name: str | None = None
    value: str | None = None
    value_from: EnvVarSource | None = None


class SourceRef(_Record, frozen=True):
    name: str | None = None


class EnvFromSource(_Record, frozen=True):
    prefix: str | None = None
    config_map_ref: SourceRef | None = None
    secret_ref: SourceRef | None = None


class VolumeMount(_Record, frozen=True):
    name: str | None = None
    mount_path: str | None = None


class SecurityContext(_Record, frozen=True):
    privileged: bool | None = None


class Container(_Record, frozen=True):
    name: str | None = None
    resources: ResourceRequirements | None = None
    env: list[EnvVar] | None = None
    env_from: list[EnvFromSource] | None = None
    volume_mounts: list[VolumeMount] | None = None
    security_context: SecurityContext | None = None
    restart_policy: str | None = None


class PodSpec(_Record, frozen=True):
    containers: list[Container] | None = None
    init_containers: list[Container] | None = None
    ephemeral_containers: list[Container] | None = None
    scheduler_name: str | None = None
    node_name: str | None = None
    runtime_class_name: str | None = None
    priority: int | None = None
    preemption_policy: str | None = None


class Pod(_Record, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    spec: PodSpec | None = None


class NodeStatus(_Record, frozen=True):
    allocatable: dict[str, Quantity] | None = None


class Node(_Record, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    status: NodeStatus | None = None


def plain(obj: msgspec.Struct) -> dict[str, Any]:
    """``obj`` as the JSON object it was read from, with only the fields named here."""
    out: dict[str, Any] = msgspec.to_builtins(obj)
    return out
