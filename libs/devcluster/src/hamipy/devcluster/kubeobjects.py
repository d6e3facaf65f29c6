"""The small pieces of kube-controller-manager's work that a devcluster needs, done by hand.

There is no kube-controller-manager, so:
- no ServiceAccount controller: the ServiceAccount admission plugin (left on, as in a real cluster)
  rejects pods in a namespace without a ``default`` ServiceAccount, so `create_namespace` makes it;
- no namespace controller: a deleted namespace would stay ``Terminating`` forever, so
  `delete_namespace` deletes the pods (grace 0: no kubelet confirms) and the usual namespaced
  objects itself, then clears the namespace's ``kubernetes`` finalizer.

Every call carries `API_TIMEOUT_S`.
"""

from __future__ import annotations

import secrets
from typing import Any, cast

# Timeout of one API request; the apiserver answers in milliseconds on loopback.
API_TIMEOUT_S = 10.0


def _is_status(exc: BaseException, *codes: int) -> bool:
    return getattr(exc, "status", None) in codes


async def ensure_default_service_account(api: Any, namespace: str) -> None:
    """Create the ``default`` ServiceAccount in `namespace` (what the ServiceAccount controller does)."""
    from kubernetes_asyncio.client import CoreV1Api
    from kubernetes_asyncio.client.exceptions import ApiException

    body = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
    try:
        await CoreV1Api(api).create_namespaced_service_account(
            namespace, cast("Any", body), _request_timeout=API_TIMEOUT_S
        )
    except ApiException as exc:
        if not _is_status(exc, 409):
            raise


async def ensure_namespace(api: Any, name: str, *, labels: dict[str, str] | None = None) -> None:
    """Create namespace `name` (if missing) with its ``default`` ServiceAccount."""
    from kubernetes_asyncio.client import CoreV1Api
    from kubernetes_asyncio.client.exceptions import ApiException

    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
    try:
        await CoreV1Api(api).create_namespace(cast("Any", body), _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if not _is_status(exc, 409):
            raise
    await ensure_default_service_account(api, name)


async def create_namespace(api: Any, *, prefix: str = "test") -> str:
    """Create a uniquely named namespace (``<prefix>-<8 hex>``) ready for pods; return its name."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    await ensure_namespace(api, name, labels={"hami-py.io/devcluster-test": "true"})
    return name


async def delete_namespace(api: Any, name: str) -> None:
    """Delete `name` and what is in it now, without a namespace controller (see module docstring)."""
    from kubernetes_asyncio.client import CoreV1Api
    from kubernetes_asyncio.client.exceptions import ApiException

    core = CoreV1Api(api)
    kw: dict[str, Any] = {"_request_timeout": API_TIMEOUT_S}
    try:
        await core.delete_collection_namespaced_pod(name, grace_period_seconds=0, **kw)
        for delete in (
            core.delete_collection_namespaced_config_map,
            core.delete_collection_namespaced_secret,
            core.delete_collection_namespaced_service_account,
            core.delete_collection_namespaced_event,
        ):
            await delete(name, **kw)
        await core.delete_namespace(name, **kw)
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name},
            "spec": {"finalizers": []},
        }
        await core.replace_namespace_finalize(name, cast("Any", body), **kw)
    except ApiException as exc:
        if not _is_status(exc, 404):
            raise
