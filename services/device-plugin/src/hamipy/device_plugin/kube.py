"""The device plugin's Kubernetes calls: its own Node and the pods bound to it.

The only module that talks to the API server, and only through ``hamipy.kube`` (raw JSON over
``KubeApi``, every call with a timeout, every failure a ``hamipy.kube.errors.KubeError``).
``NodeKube`` binds this node's name and the per-call timeout to ``hamipy.kube.resources``; the
pod informer (``node_pods_informer``) is ``hamipy.kube.informer.Informer`` narrowed to this node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from hamipy.kube.client import API_TIMEOUT_S, KubeApi
from hamipy.kube.informer import Informer, InformerSettings, Logger
from hamipy.kube.node_lock import Released, release_node_lock
from hamipy.kube.resources import (
    get_node,
    list_all,
    node_pods_query,
    patch_node_annotations,
    patch_pod_annotations,
    pod_path,
)

__all__ = ["PODS_PATH", "NodeKube", "node_pods_informer"]

PODS_PATH: Final = pod_path()
"""Pods of every namespace: narrowed to one node by ``node_pods_query``."""


def node_pods_informer(
    api: KubeApi, node_name: str, *, logger: Logger, settings: InformerSettings
) -> Informer:
    """A list+watch of the pods bound to ``node_name``, kept in its cache (``keep``)."""
    return Informer(
        api, PODS_PATH, logger=logger, query=node_pods_query(node_name), settings=settings, keep=True
    )


class NodeKube:
    """The calls about one node, on ``api``; each with ``timeout_s``."""

    def __init__(self, api: KubeApi, *, node_name: str, timeout_s: float = API_TIMEOUT_S) -> None:
        self.api = api
        self.node_name = node_name
        self.timeout_s = timeout_s

    async def get_node(self) -> dict[str, Any]:
        return await get_node(self.api, self.node_name, timeout_s=self.timeout_s)

    async def patch_node_annotations(
        self, annotations: Mapping[str, str | None], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        """Merge-patch this node's annotations (None removes one); with ``resource_version`` the
        write lands only on that version, else ``Conflict``."""
        return await patch_node_annotations(
            self.api, self.node_name, annotations, resource_version=resource_version, timeout_s=self.timeout_s
        )

    async def node_pods(self) -> tuple[list[dict[str, Any]], str]:
        """Every pod bound to this node (paged), and the list's resourceVersion."""
        return await list_all(
            self.api, PODS_PATH, query=node_pods_query(self.node_name), timeout_s=self.timeout_s
        )

    async def patch_pod_annotations(
        self, namespace: str, name: str, uid: str, annotations: Mapping[str, str | None]
    ) -> dict[str, Any]:
        """Merge-patch a pod's annotations; the UID precondition keeps a same-named new pod safe.
        Returns the pod as written."""
        return await patch_pod_annotations(
            self.api, namespace, name, uid, annotations, timeout_s=self.timeout_s
        )

    async def release_node_lock(self, namespace: str, name: str) -> Released:
        """Remove this node's lock if the pod ``namespace/name`` holds it (never another pod's)."""
        return await release_node_lock(
            self.api, self.node_name, namespace=namespace, name=name, timeout_s=self.timeout_s
        )
