"""The device plugin's Kubernetes calls: its own Node and the pods bound to it, as raw JSON.

The only module that talks to the API server. Every call has a timeout; errors come out as
``hamipy.device_plugin.errors.KubeError`` (``Conflict`` for a lost resourceVersion race).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import aiohttp
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from hamipy.device_plugin.errors import Conflict, KubeError

__all__ = ["NodeApi"]

MERGE_PATCH: Final = "application/merge-patch+json"


class NodeApi:
    """Calls about one node, over a kubernetes_asyncio ``ApiClient`` (the caller owns and closes it)."""

    def __init__(self, api_client: Any, *, node_name: str, timeout_s: float) -> None:
        self.core = CoreV1Api(api_client)
        self.node_name = node_name
        self.timeout_s = timeout_s

    async def _json(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await call(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
                try:
                    data = await resp.read()
                finally:
                    resp.release()
        except ApiException as exc:
            message = exc.reason
            with contextlib.suppress(ValueError, AttributeError):
                message = json.loads(exc.body or b"{}").get("message", message)
            error = Conflict if exc.status == 409 else KubeError
            raise error(f"{what}: HTTP {exc.status}: {message}", status=exc.status or 0) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        return json.loads(data) if data else None

    async def get_node(self) -> dict[str, Any]:
        node: dict[str, Any] = await self._json(
            f"GET node {self.node_name}", self.core.read_node, self.node_name
        )
        return node

    async def patch_node_annotations(
        self, annotations: Mapping[str, str | None], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        """Merge-patch this node's annotations (None removes one); with ``resource_version`` the
        write lands only on that version, else ``Conflict``."""
        meta: dict[str, Any] = {"annotations": dict(annotations)}
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        node: dict[str, Any] = await self._json(
            f"PATCH node {self.node_name}",
            self.core.patch_node,
            self.node_name,
            {"metadata": meta},
            _content_type=MERGE_PATCH,
        )
        return node

    async def node_pods(self) -> tuple[list[dict[str, Any]], str]:
        """Every pod bound to this node, and the list's resourceVersion."""
        data = await self._json(
            f"LIST pods on {self.node_name}",
            self.core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={self.node_name}",
        )
        items: list[dict[str, Any]] = data.get("items") or []
        return items, str((data.get("metadata") or {}).get("resourceVersion", ""))

    async def watch_node_pods(
        self, resource_version: str, *, timeout_s: int, inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) of this node's pods from ``resource_version``, with
        bookmarks, until the server ends the watch after ``timeout_s``; a stream silent for
        ``inactivity_s`` is an error."""
        what = f"WATCH pods on {self.node_name}"
        try:
            resp: Any = await self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.node_name}",
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=resource_version,
                timeout_seconds=timeout_s,
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.timeout_s, sock_read=inactivity_s
                ),
            )
        except ApiException as exc:
            raise KubeError(f"{what}: HTTP {exc.status}: {exc.reason}", status=exc.status or 0) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        buffer = b""
        try:
            # Not `async for line in resp.content`: its line limit (64 KiB) is below a large pod.
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        finally:
            resp.release()

    async def patch_pod_annotations(
        self, namespace: str, name: str, uid: str, annotations: Mapping[str, str | None]
    ) -> dict[str, Any]:
        """Merge-patch a pod's annotations; the UID precondition keeps a same-named new pod safe.
        Returns the pod as written."""
        body = {"metadata": {"uid": uid, "annotations": dict(annotations)}}
        pod: dict[str, Any] = await self._json(
            f"PATCH pod {namespace}/{name}",
            self.core.patch_namespaced_pod,
            name,
            namespace,
            body,
            _content_type=MERGE_PATCH,
        )
        return pod
