"""The small pieces of kube-controller-manager's work that a devcluster needs, done by hand.

There is no kube-controller-manager, so:
- no ServiceAccount controller: the ServiceAccount admission plugin (left on, as in a real cluster)
  rejects pods in a namespace without a ``default`` ServiceAccount, so `create_namespace` makes it;
- no namespace controller: a deleted namespace would stay ``Terminating`` forever, so
  `delete_namespace` deletes the pods (grace 0: no kubelet confirms) and the usual namespaced
  objects itself, then clears the namespace's ``kubernetes`` finalizer.

Every call goes through ``hamipy.kube.client.RawKube`` over the caller's ``ApiClient``, with its
timeout (`API_TIMEOUT_S`) and its errors (``hamipy.kube.errors``: a ``KubeError`` other than the
``Conflict``/``NotFound`` each helper expects is raised).
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

from hamipy.kube.client import API_TIMEOUT_S, RawKube
from hamipy.kube.errors import Conflict, NotFound

__all__ = [
    "API_TIMEOUT_S",
    "create_namespace",
    "delete_namespace",
    "ensure_default_service_account",
    "ensure_namespace",
]

# The namespaced collections `delete_namespace` empties, pods first.
_NAMESPACED: tuple[str, ...] = ("pods", "configmaps", "secrets", "serviceaccounts", "events")


async def ensure_default_service_account(api: Any, namespace: str) -> None:
    """Create the ``default`` ServiceAccount in `namespace` (what the ServiceAccount controller does)."""
    body = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
    with contextlib.suppress(Conflict):
        await RawKube(api).request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", body=body)


async def ensure_namespace(api: Any, name: str, *, labels: dict[str, str] | None = None) -> None:
    """Create namespace `name` (if missing) with its ``default`` ServiceAccount."""
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
    with contextlib.suppress(Conflict):
        await RawKube(api).request("POST", "/api/v1/namespaces", body=body)
    await ensure_default_service_account(api, name)


async def create_namespace(api: Any, *, prefix: str = "test") -> str:
    """Create a uniquely named namespace (``<prefix>-<8 hex>``) ready for pods; return its name."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    await ensure_namespace(api, name, labels={"hami-py.io/devcluster-test": "true"})
    return name


async def delete_namespace(api: Any, name: str) -> None:
    """Delete `name` and what is in it now, without a namespace controller (see module docstring)."""
    kube = RawKube(api)
    namespace = f"/api/v1/namespaces/{name}"
    try:
        for collection in _NAMESPACED:
            # Pods go at once: no kubelet would confirm a graceful deletion.
            query = [("gracePeriodSeconds", "0")] if collection == "pods" else []
            await kube.request("DELETE", f"{namespace}/{collection}", query=query)
        await kube.request("DELETE", namespace)
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name},
            "spec": {"finalizers": []},
        }
        await kube.request("PUT", f"{namespace}/finalize", body=body)
    except NotFound:
        pass
