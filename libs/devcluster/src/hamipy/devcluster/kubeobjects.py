"""The small pieces of cluster plumbing a devcluster's tests and `make up` need.

kube-controller-manager runs in the dev cluster (``cluster``), so its ServiceAccount controller makes
every namespace's ``default`` ServiceAccount: `ensure_namespace` waits for it, since the
ServiceAccount admission plugin refuses pods until it exists. There is no kubelet to confirm a pod's
deletion on the simulated nodes, so `delete_namespace` deletes the workload controllers (so nothing
makes pods again), the pods at once (grace 0) and the usual namespaced objects itself, then clears
the namespace's ``kubernetes`` finalizer instead of waiting for the namespace controller to find the
pods gone.

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
    "ensure_crds",
    "ensure_namespace",
    "open_crd",
    "wait_for_default_service_account",
]

SA_WAIT_S = 60.0
"""The ServiceAccount controller answers within a second; the rest is headroom for a loaded CI box."""

# The namespaced collections `delete_namespace` empties: apps/v1 workloads, then core objects, pods first.
_WORKLOADS: tuple[str, ...] = ("deployments", "replicasets", "statefulsets", "daemonsets")
_NAMESPACED: tuple[str, ...] = ("pods", "configmaps", "secrets", "serviceaccounts", "events")


async def wait_for_default_service_account(api: Any, namespace: str, *, timeout_s: float = SA_WAIT_S) -> None:
    """Return once kube-controller-manager has made ``namespace``'s ``default`` ServiceAccount."""
    from hamipy.devcluster.waiting import wait_for

    kube = RawKube(api)

    async def made() -> bool:
        try:
            await kube.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
        except NotFound:
            return False
        return True

    await wait_for(made, timeout=timeout_s, interval=0.1, what=f"ServiceAccount {namespace}/default")


async def ensure_namespace(api: Any, name: str, *, labels: dict[str, str] | None = None) -> None:
    """Create namespace `name` (if missing); return once its ``default`` ServiceAccount exists."""
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
    with contextlib.suppress(Conflict):
        await RawKube(api).request("POST", "/api/v1/namespaces", body=body)
    await wait_for_default_service_account(api, name)


async def ensure_runtime_class(api: Any, name: str, handler: str) -> None:
    """Create RuntimeClass ``name`` for the runtime ``handler`` (if missing)."""
    body = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": name},
        "handler": handler,
    }
    with contextlib.suppress(Conflict):
        await RawKube(api).request("POST", "/apis/node.k8s.io/v1/runtimeclasses", body=body)


async def create_namespace(api: Any, *, prefix: str = "test") -> str:
    """Create a uniquely named namespace (``<prefix>-<8 hex>``) ready for pods; return its name."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    await ensure_namespace(api, name, labels={"hami-py.io/devcluster-test": "true"})
    return name


async def delete_namespace(api: Any, name: str, *, timeout_s: float = API_TIMEOUT_S) -> None:
    """Delete `name` and what is in it now, without a namespace controller (see module docstring);
    ``timeout_s`` per request (a collection of thousands of pods takes the API server a while)."""
    kube = RawKube(api)
    namespace = f"/api/v1/namespaces/{name}"
    try:
        # Workload controllers first, so that nothing makes pods again after they are deleted.
        for collection in _WORKLOADS:
            await kube.request("DELETE", f"/apis/apps/v1/namespaces/{name}/{collection}", timeout_s=timeout_s)
        for collection in _NAMESPACED:
            # Pods go at once: no kubelet would confirm a graceful deletion.
            query = [("gracePeriodSeconds", "0")] if collection == "pods" else []
            await kube.request("DELETE", f"{namespace}/{collection}", query=query, timeout_s=timeout_s)
        await kube.request("DELETE", namespace, timeout_s=timeout_s)
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name},
            "spec": {"finalizers": []},
        }
        await kube.request("PUT", f"{namespace}/finalize", body=body, timeout_s=timeout_s)
    except NotFound:
        pass


CRDS_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
CRD_ESTABLISHED_S = 30.0


def open_crd(group: str, version: str, kind: str, plural: str) -> dict[str, Any]:
    """A namespaced CustomResourceDefinition whose schema takes anything: where the project that
    owns the kind is not installed (cert-manager, the Prometheus operator), the API server then
    stores the objects the chart creates of it, as they are."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }


async def ensure_crds(api: Any, crds: list[dict[str, Any]]) -> None:
    """Create ``crds`` (those there already are kept) and wait until each is Established."""
    from hamipy.devcluster.waiting import wait_for

    kube = RawKube(api)
    for crd in crds:
        with contextlib.suppress(Conflict):
            await kube.request("POST", CRDS_PATH, body=crd)
    for crd in crds:
        name = crd["metadata"]["name"]

        async def established(name: str = name) -> bool:
            found = await kube.request("GET", f"{CRDS_PATH}/{name}")
            conditions = found.get("status", {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        await wait_for(established, timeout=CRD_ESTABLISHED_S, interval=0.2, what=f"CRD {name} established")
