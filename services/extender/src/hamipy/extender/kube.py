"""The only module that talks to the Kubernetes API: raw JSON over kubernetes-asyncio's client.

Objects stay plain dicts (no generated models: decoding 10,000 pods into them would cost more than
the whole model). ``KubeApi`` is the small interface the rest of the extender uses, so tests can
hand it a fake; ``ApiClientKube`` implements it with a ``kubernetes_asyncio.client.ApiClient``
(its configuration supplies the server, certificates and token). Every call has a timeout; errors
come out as ``hamipy.extender.errors.KubeError`` subclasses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Final, Protocol

import aiohttp

from hamipy.extender.errors import Conflict, Gone, KubeError, NotFound

__all__ = [
    "MERGE_PATCH",
    "ApiClientKube",
    "KubeApi",
    "create_binding",
    "create_event",
    "get_event",
    "get_node",
    "get_pod",
    "list_all",
    "list_pods",
    "patch_event",
    "patch_node",
    "patch_pod",
]

MERGE_PATCH: Final = "application/merge-patch+json"
_JSON: Final = "application/json"
_CHUNK_LIMIT: Final = 32 * 1024 * 1024
"""Longest single watch event accepted (an object is at most ~1.5 MiB in etcd)."""

Query = Sequence[tuple[str, str]]


class KubeApi(Protocol):
    """The two operations everything else is built on."""

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Query = (),
        body: Any = None,
        content_type: str = _JSON,
        timeout_s: float,
    ) -> Any:
        """One call; the decoded JSON answer. Raises ``KubeError`` (``NotFound``, ``Conflict``...)."""
        ...

    def stream(self, path: str, *, query: Query, inactivity_s: float) -> AsyncIterator[dict[str, Any]]:
        """A watch: one decoded JSON object per line until the server ends it."""
        ...


def _error(status: int, what: str, body: bytes) -> KubeError:
    try:
        message = json.loads(body).get("message", "")
    except (ValueError, AttributeError):
        message = body[:200].decode(errors="replace")
    text = f"{what}: HTTP {status}: {message}"
    if status == 404:
        return NotFound(text, status=status)
    if status == 409:
        return Conflict(text, status=status)
    if status == 410:
        return Gone(text, status=status)
    return KubeError(text, status=status)


class ApiClientKube:
    """``KubeApi`` over a kubernetes_asyncio ``ApiClient`` (the caller owns and closes it)."""

    def __init__(self, api_client: Any) -> None:
        self.api_client = api_client

    async def _call(
        self,
        method: str,
        path: str,
        query: Query,
        body: Any,
        content_type: str,
        client_timeout: aiohttp.ClientTimeout,
    ) -> Any:
        return await self.api_client.call_api(
            path,
            method,
            query_params=list(query),
            header_params={"Accept": _JSON, "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=client_timeout,
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Query = (),
        body: Any = None,
        content_type: str = _JSON,
        timeout_s: float,
    ) -> Any:
        what = f"{method} {path}"
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._call(
                    method, path, query, body, content_type, aiohttp.ClientTimeout(total=timeout_s)
                )
                try:
                    data = await resp.read()
                finally:
                    resp.release()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if not 200 <= resp.status <= 299:
            raise _error(resp.status, what, data)
        return json.loads(data) if data else None

    async def stream(self, path: str, *, query: Query, inactivity_s: float) -> AsyncIterator[dict[str, Any]]:
        what = f"WATCH {path}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=inactivity_s)
        try:
            resp = await self._call("GET", path, query, None, _JSON, timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        try:
            if resp.status != 200:
                raise _error(resp.status, what, await resp.read())
            buffer = b""
            try:
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if line.strip():
                            yield json.loads(line)
                    if len(buffer) > _CHUNK_LIMIT:
                        raise KubeError(f"{what}: event longer than {_CHUNK_LIMIT} bytes")
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        finally:
            resp.release()


# -- typed helpers ---------------------------------------------------------------------------------


async def get_node(api: KubeApi, name: str, *, timeout_s: float) -> dict[str, Any]:
    node: dict[str, Any] = await api.request("GET", f"/api/v1/nodes/{name}", timeout_s=timeout_s)
    return node


async def patch_node(
    api: KubeApi,
    name: str,
    annotations: Mapping[str, str | None],
    *,
    resource_version: str | None,
    timeout_s: float,
) -> dict[str, Any]:
    """Merge-patch node annotations; with ``resource_version`` the write only lands on that version
    (else ``Conflict``)."""
    meta: dict[str, Any] = {"annotations": dict(annotations)}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    node: dict[str, Any] = await api.request(
        "PATCH",
        f"/api/v1/nodes/{name}",
        body={"metadata": meta},
        content_type=MERGE_PATCH,
        timeout_s=timeout_s,
    )
    return node


async def get_pod(api: KubeApi, namespace: str, name: str, *, timeout_s: float) -> dict[str, Any]:
    pod: dict[str, Any] = await api.request(
        "GET", f"/api/v1/namespaces/{namespace}/pods/{name}", timeout_s=timeout_s
    )
    return pod


async def patch_pod(
    api: KubeApi, namespace: str, name: str, body: Mapping[str, Any], *, timeout_s: float
) -> dict[str, Any]:
    pod: dict[str, Any] = await api.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}/pods/{name}",
        body=dict(body),
        content_type=MERGE_PATCH,
        timeout_s=timeout_s,
    )
    return pod


async def list_pods(api: KubeApi, *, query: Query, timeout_s: float) -> list[dict[str, Any]]:
    items, _ = await list_all(api, "/api/v1/pods", query=query, timeout_s=timeout_s)
    return items


async def list_all(
    api: KubeApi, path: str, *, query: Query = (), timeout_s: float, page: int = 500
) -> tuple[list[dict[str, Any]], str]:
    """Every item of a collection (paginated), and the list's resourceVersion."""
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
    api: KubeApi, namespace: str, name: str, uid: str, node: str, *, timeout_s: float
) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    await api.request(
        "POST", f"/api/v1/namespaces/{namespace}/pods/{name}/binding", body=body, timeout_s=timeout_s
    )


def _event_path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/events"
    return f"{base}/{name}" if name else base


async def create_event(
    api: KubeApi,
    *,
    name: str,
    involved: Mapping[str, str],
    reason: str,
    message: str,
    warning: bool,
    component: str,
    count: int,
    first: str,
    last: str,
    timeout_s: float,
) -> None:
    """A core/v1 Event ``name`` about ``involved`` (kind, name, namespace, uid) seen ``count`` times
    between ``first`` and ``last`` (RFC 3339); nodes' go to ``default``. ``Conflict`` when it exists."""
    namespace = involved.get("namespace") or "default"
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", **involved},
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": first,
        "lastTimestamp": last,
        "count": count,
    }
    await api.request("POST", _event_path(namespace), body=body, timeout_s=timeout_s)


async def patch_event(
    api: KubeApi, namespace: str, name: str, *, count: int, last: str, message: str, timeout_s: float
) -> None:
    """Raise an existing Event's count and last time, with the latest message (``NotFound`` when
    it expired)."""
    body = {"count": count, "lastTimestamp": last, "message": message[:1024]}
    await api.request(
        "PATCH", _event_path(namespace, name), body=body, content_type=MERGE_PATCH, timeout_s=timeout_s
    )


async def get_event(api: KubeApi, namespace: str, name: str, *, timeout_s: float) -> dict[str, Any]:
    event: dict[str, Any] = await api.request("GET", _event_path(namespace, name), timeout_s=timeout_s)
    return event
