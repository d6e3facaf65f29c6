"""A filter's arguments, read without decoding the pod in them when the watch holds that pod.

kube-scheduler sends the whole Pod with every filter (``ExtenderArgs``: ``Pod``, ``NodeNames``).
For a pod the watch holds pending, the extender decides from its own copy (``Scheduler.watches``),
so decoding the copy sent, then checking its depth and its field types, would be a large share
of a filter's CPU, on the path each ``/filter`` waits on. Here msgspec reads the three fields
needed into typed structs and skips the rest of the body without building it.

Anything else is read whole, with the whole decoder's errors: a pod the watch does not hold, node
objects sent instead of names (a scheduler that is not ``nodeCacheCapable``), a field of another
type, a body that is not JSON or nests deeper than the parser goes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec

__all__ = ["watched_filter_args"]


class _Meta(msgspec.Struct):
    uid: str = ""


class _Pod(msgspec.Struct):
    metadata: _Meta | None = None


class _Head(msgspec.Struct, rename={"pod": "Pod", "node_names": "NodeNames", "nodes": "Nodes"}):
    pod: _Pod | None = None
    node_names: list[str] | None = None
    nodes: Any = None


_decoder: Final = msgspec.json.Decoder(_Head)


def watched_filter_args(body: bytes, watches: Callable[[str], bool]) -> dict[str, Any] | None:
    """``ExtenderArgs`` naming only the pod's UID and the node names, when ``watches`` that UID and
    the body is plainly well formed; None: decode the body whole."""
    try:
        head = _decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):  # DecodeError covers ValidationError
        return None
    if head.nodes is not None or head.node_names is None or head.pod is None or head.pod.metadata is None:
        return None
    uid = head.pod.metadata.uid
    if not uid or not watches(uid):
        return None
    return {"Pod": {"metadata": {"uid": uid}}, "NodeNames": head.node_names}
