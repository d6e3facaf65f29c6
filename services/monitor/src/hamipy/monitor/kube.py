"""The monitor's Kubernetes calls: list and watch the pods bound to its node, as raw JSON.

The only module that talks to the API server; it only reads. Every call has a timeout (a watch has
a connect timeout and an inactivity timeout, and the server ends it after ``timeout_s``); errors
come out as ``hamipy.monitor.errors.KubeError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from hamipy.monitor.errors import KubeError

__all__ = ["NodePodsApi", "PodsApi"]


class PodsApi(Protocol):
    """What the pod cache needs from the API (tests hand it a fake)."""

    async def list_pods(self) -> tuple[list[dict[str, Any]], str]: ...

    def watch_pods(
        self, resource_version: str, *, timeout_s: int, inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]: ...


class NodePodsApi:
    """The pods of one node over a kubernetes_asyncio ``ApiClient`` (the caller owns and closes it)."""

    def __init__(self, api_client: Any, *, node_name: str, timeout_s: float) -> None:
        self.core = CoreV1Api(api_client)
        self.node_name = node_name
        self.timeout_s = timeout_s
        self.selector = f"spec.nodeName={node_name}"

    async def list_pods(self) -> tuple[list[dict[str, Any]], str]:
        """Every pod bound to this node, and the list's resourceVersion."""
        what = f"LIST pods on {self.node_name}"
        try:
            async with asyncio.timeout(self.timeout_s):
                resp: Any = await self.core.list_pod_for_all_namespaces(
                    field_selector=self.selector, _preload_content=False, _request_timeout=self.timeout_s
                )
                try:
                    data = json.loads(await resp.read())
                finally:
                    resp.release()
        except ApiException as exc:
            raise KubeError(f"{what}: HTTP {exc.status}: {_message(exc)}", status=exc.status or 0) from exc
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        items: list[dict[str, Any]] = data.get("items") or []
        return items, str((data.get("metadata") or {}).get("resourceVersion", ""))

    async def watch_pods(
        self, resource_version: str, *, timeout_s: int, inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) from ``resource_version``, bookmarks included,
        until the server ends the watch; a stream silent for ``inactivity_s`` is an error."""
        what = f"WATCH pods on {self.node_name}"
        try:
            resp: Any = await self.core.list_pod_for_all_namespaces(
                field_selector=self.selector,
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
            raise KubeError(f"{what}: HTTP {exc.status}: {_message(exc)}", status=exc.status or 0) from exc
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


def _message(exc: ApiException) -> str:
    message = str(exc.reason)
    with contextlib.suppress(ValueError, AttributeError):
        message = json.loads(exc.body or b"{}").get("message", message)
    return message
