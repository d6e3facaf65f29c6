"""kube-scheduler's extender arguments, decoded in one pass into typed records
(docs/wire-format.md#scheduler-extender).

``ExtenderArgs`` (``/filter``, ``/prioritize``), ``ExtenderBindingArgs`` (``/bind``) and
``ExtenderPreemptionArgs`` (``/preempt``) carry Go's field names; only the fields the decisions
read are named (the pod's, ``hamipy.protocol.kube_objects``), anything else is skipped unread.
``decode_args`` turns a body that is not JSON, or whose named fields have the wrong JSON type, into
``BadRequest`` with msgspec's words and the field's path (``$.Pod.metadata.uid``), answered HTTP 400.
Skipping a value nests in C with Python's recursion guard: a body nested deeper than that is a
``RecursionError``, refused the same way.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, TypeVar

import msgspec

from hamipy.extender.errors import BadRequest
from hamipy.protocol.identifiers import NodeName, PodUid
from hamipy.protocol.kube_objects import Node, Pod

__all__ = [
    "ExtenderArgs",
    "ExtenderBindingArgs",
    "ExtenderPreemptionArgs",
    "MetaVictims",
    "decode_args",
]


class NodeList(msgspec.Struct, frozen=True):
    items: list[Node] | None = None


class ExtenderArgs(
    msgspec.Struct, frozen=True, rename={"pod": "Pod", "nodes": "Nodes", "node_names": "NodeNames"}
):
    """``/filter`` and ``/prioritize``: the pod and its candidate nodes, by name (a
    ``nodeCacheCapable`` extender, ours) or as Node objects."""

    pod: Pod
    nodes: NodeList | None = None
    node_names: list[NodeName] | None = None


class ExtenderBindingArgs(
    msgspec.Struct,
    frozen=True,
    rename={"pod_name": "PodName", "pod_namespace": "PodNamespace", "pod_uid": "PodUID", "node": "Node"},
):
    pod_name: str
    pod_namespace: str
    node: NodeName
    pod_uid: PodUid = PodUid("")


class _MetaPod(msgspec.Struct, frozen=True, rename={"uid": "UID"}):
    uid: PodUid


class _VictimMeta(msgspec.Struct, frozen=True):
    uid: PodUid


class _VictimPod(msgspec.Struct, frozen=True):
    metadata: _VictimMeta


_Violations = Annotated[int, msgspec.Meta(ge=0)]


class MetaVictims(msgspec.Struct, frozen=True, rename={"pods": "Pods", "violations": "NumPDBViolations"}):
    """One node's victims, by UID, and how many PodDisruptionBudgets their eviction violates."""

    pods: list[_MetaPod] | None = None
    violations: _Violations = 0

    def uids(self) -> list[PodUid]:
        return [p.uid for p in self.pods or ()]


class _Victims(msgspec.Struct, frozen=True, rename={"pods": "Pods", "violations": "NumPDBViolations"}):
    pods: list[_VictimPod] | None = None
    violations: _Violations = 0

    def as_meta(self) -> MetaVictims:
        return MetaVictims([_MetaPod(p.metadata.uid) for p in self.pods or ()], self.violations)


class ExtenderPreemptionArgs(
    msgspec.Struct,
    frozen=True,
    rename={"pod": "Pod", "victims": "NodeNameToVictims", "meta_victims": "NodeNameToMetaVictims"},
):
    """``/preempt``: kube-scheduler's victims per node, by UID (to a ``nodeCacheCapable``
    extender) or as whole pods."""

    pod: Pod
    victims: dict[NodeName, _Victims] | None = None
    meta_victims: dict[NodeName, MetaVictims] | None = None

    def proposed(self) -> dict[NodeName, MetaVictims]:
        if self.meta_victims is not None:
            return self.meta_victims
        return {node: victims.as_meta() for node, victims in (self.victims or {}).items()}


_Args = TypeVar("_Args", ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs)

_DECODERS: Final[dict[type[Any], msgspec.json.Decoder[Any]]] = {
    kind: msgspec.json.Decoder(kind) for kind in (ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs)
}


def decode_args(body: bytes, kind: type[_Args]) -> _Args:
    """``body`` as ``kind``; ``BadRequest`` naming what is wrong and where."""
    try:
        args: _Args = _DECODERS[kind].decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"not {kind.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("body is JSON nested too deeply to read") from None
    return args
