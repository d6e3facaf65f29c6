"""Typed calls on the objects hami-py reads and writes: nodes, pods, bindings, lists; Lease paths.

Each is one ``KubeApi.request`` with a timeout; errors are ``hamipy.kube.errors.KubeError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from hamipy.kube.client import API_TIMEOUT_S, MERGE_PATCH, KubeApi, Query

__all__ = [
    "LIST_PAGE",
    "create_binding",
    "get_node",
    "get_pod",
    "lease_path",
    "list_all",
    "node_path",
    "node_pods_query",
    "patch_node_annotations",
    "patch_pod",
    "patch_pod_annotations",
    "pod_path",
]

LIST_PAGE: Final = 500
"""Items per list page: kubectl's size, and small enough that one page never times out."""


def node_path(name: str = "") -> str:
    return f"/api/v1/nodes/{name}" if name else "/api/v1/nodes"


def pod_path(namespace: str = "", name: str = "") -> str:
    if not namespace:
        return "/api/v1/pods"
    base = f"/api/v1/namespaces/{namespace}/pods"
    return f"{base}/{name}" if name else base


def lease_path(namespace: str, name: str = "") -> str:
    """A ``coordination.k8s.io/v1`` Lease in ``namespace`` (its collection without ``name``)."""
    base = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    return f"{base}/{name}" if name else base


def node_pods_query(node: str) -> list[tuple[str, str]]:
    """The field selector of the pods bound to ``node`` (with ``pod_path()``, every namespace)."""
    return [("fieldSelector", f"spec.nodeName={node}")]


async def get_node(api: KubeApi, name: str, *, timeout_s: float = API_TIMEOUT_S) -> dict[str, Any]:
    node: dict[str, Any] = await api.request("GET", node_path(name), timeout_s=timeout_s)
    return node


async def patch_node_annotations(
    api: KubeApi,
    name: str,
    annotations: Mapping[str, str | None],
    *,
    resource_version: str | None = None,
    timeout_s: float = API_TIMEOUT_S,
) -> dict[str, Any]:
    """Merge-patch a node's annotations (None removes one); with ``resource_version`` the write
    lands only on that version, else ``Conflict``. Returns the node as written."""
    meta: dict[str, Any] = {"annotations": dict(annotations)}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    node: dict[str, Any] = await api.request(
        "PATCH", node_path(name), body={"metadata": meta}, content_type=MERGE_PATCH, timeout_s=timeout_s
    )
    return node


async def get_pod(
    api: KubeApi, namespace: str, name: str, *, timeout_s: float = API_TIMEOUT_S
) -> dict[str, Any]:
    pod: dict[str, Any] = await api.request("GET", pod_path(namespace, name), timeout_s=timeout_s)
    return pod


async def patch_pod(
    api: KubeApi, namespace: str, name: str, body: Mapping[str, Any], *, timeout_s: float = API_TIMEOUT_S
) -> dict[str, Any]:
    """Merge-patch a pod with ``body``; returns the pod as written."""
    pod: dict[str, Any] = await api.request(
        "PATCH", pod_path(namespace, name), body=dict(body), content_type=MERGE_PATCH, timeout_s=timeout_s
    )
    return pod


async def patch_pod_annotations(
    api: KubeApi,
    namespace: str,
    name: str,
    uid: str,
    annotations: Mapping[str, str | None],
    *,
    timeout_s: float = API_TIMEOUT_S,
) -> dict[str, Any]:
    """Merge-patch a pod's annotations under a UID precondition (a new pod of the same name is
    never touched: ``Conflict``); returns the pod as written."""
    body = {"metadata": {"uid": uid, "annotations": dict(annotations)}}
    return await patch_pod(api, namespace, name, body, timeout_s=timeout_s)


async def list_all(
    api: KubeApi, path: str, *, query: Query = (), timeout_s: float = API_TIMEOUT_S, page: int = LIST_PAGE
) -> tuple[list[dict[str, Any]], str]:
    """Every item of a collection, page by page (each page its own call and timeout), and the
    list's resourceVersion (to watch from)."""
    items: list[dict[str, Any]] = []
    token = ""
    while True:
        params = [*query, ("limit", str(page))]
        if token:
            params.append(("continue", token))
        data = await api.request("GET", path, query=params, timeout_s=timeout_s)
        items.extend(data.get("items") or [])
        meta = data.get("metadata") or {}
        token = meta.get("continue") or ""
        if not token:
            return items, str(meta.get("resourceVersion", ""))


async def create_binding(
    api: KubeApi,
    namespace: str,
    name: str,
    uid: str,
    node: str,
    *,
    annotations: Mapping[str, str] | None = None,
    resource_version: str | None = None,
    timeout_s: float = API_TIMEOUT_S,
) -> None:
    """Bind a pod to ``node`` (the ``binding`` subresource), only if it is still the pod ``uid``
    (and, with ``resource_version``, unchanged since that version: else ``Conflict``). The API
    server copies ``annotations`` onto the pod in the same write that sets ``spec.nodeName``."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid}
    if annotations:
        metadata["annotations"] = dict(annotations)
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": metadata,
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    await api.request("POST", f"{pod_path(namespace, name)}/binding", body=body, timeout_s=timeout_s)
