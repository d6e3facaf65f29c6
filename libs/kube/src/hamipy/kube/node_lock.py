"""Releasing HAMi's node lock (``hami.io/mutex.lock``; its format is ``hamipy.protocol.node_lock``).

The extender releases it when a bind fails or, in our own lock discipline, once the bind is done;
the device plugin when Allocate is done (HAMi's). Either way a lock is only ever removed by a write
preconditioned on the node's resourceVersion, and only while it names the pod releasing it: a lock
another pod took meanwhile is never removed.
"""

from __future__ import annotations

from typing import Final, Literal

from hamipy.kube.client import API_TIMEOUT_S, KubeApi
from hamipy.kube.errors import Conflict
from hamipy.kube.resources import get_node, patch_node_annotations
from hamipy.protocol import keys
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_lock import owned_by, parse_node_lock

__all__ = ["RELEASE_ATTEMPTS", "Released", "release_node_lock"]

RELEASE_ATTEMPTS: Final = 5
"""Writes lost to other writers of the node (heartbeats, handshakes) before giving up; the lock's
expiry frees the node in the end either way."""

Released = Literal["released", "not-ours", "contended"]


async def release_node_lock(
    api: KubeApi,
    node: str,
    *,
    namespace: str,
    name: str,
    attempts: int = RELEASE_ATTEMPTS,
    timeout_s: float = API_TIMEOUT_S,
) -> Released:
    """Remove the lock on ``node`` if it is held by the pod ``namespace/name``.

    ``released``; ``not-ours`` (no lock, another pod's, or unreadable: left alone); or
    ``contended`` (every attempt lost a write race). API failures raise ``KubeError``.
    """
    for _ in range(attempts):
        obj = await get_node(api, node, timeout_s=timeout_s)
        metadata = obj.get("metadata") or {}
        value = (metadata.get("annotations") or {}).get(keys.NODE_LOCK)
        if not value:
            return "not-ours"
        try:
            if not owned_by(parse_node_lock(value), namespace=namespace, name=name):
                return "not-ours"
        except ProtocolError:
            return "not-ours"
        try:
            await patch_node_annotations(
                api,
                node,
                {keys.NODE_LOCK: None},
                resource_version=str(metadata.get("resourceVersion", "")),
                timeout_s=timeout_s,
            )
        except Conflict:
            continue
        return "released"
    return "contended"
