"""Wait for a condition with a deadline, and fail saying what was awaited and what was last seen.

Tests synchronise only through these (never a bare sleep): they poll an async or sync predicate
every `interval` seconds until it returns something truthy, which they return.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from hamipy.devcluster.errors import WaitTimeout
from hamipy.devcluster.kubeobjects import API_TIMEOUT_S

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_INTERVAL_S = 0.1


@overload
async def wait_for(
    predicate: Callable[[], Awaitable[T]],
    *,
    timeout: float = ...,  # noqa: ASYNC109
    interval: float = ...,
    what: str = ...,
) -> T: ...


@overload
async def wait_for(
    predicate: Callable[[], T],
    *,
    timeout: float = ...,  # noqa: ASYNC109
    interval: float = ...,
    what: str = ...,
) -> T: ...


async def wait_for(
    predicate: Callable[[], Any],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109 - a polling deadline, part of the API
    interval: float = DEFAULT_INTERVAL_S,
    what: str = "",
) -> Any:
    """Call `predicate` until it returns a truthy value and return that value.

    An exception from the predicate counts as "not yet" (and is shown if time runs out). Raises
    `WaitTimeout` naming `what` and the last value or error after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = predicate()
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout=max(interval, deadline - time.monotonic()))
            if result:
                return result
            last = result
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            last = exc
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", repr(predicate))
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {name}; last seen: {last!r}")
        await asyncio.sleep(interval)


def _scheduling_story(pod: Any) -> str:
    conds = (pod.status.conditions or []) if pod.status else []
    parts = [f"{c.type}={c.status} {c.reason or ''}: {c.message or ''}".strip() for c in conds]
    return "; ".join(parts) or f"phase={getattr(pod.status, 'phase', None)}, no conditions"


async def wait_pod_bound(
    api: Any,
    namespace: str,
    name: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109 - a polling deadline, part of the API
    interval: float = DEFAULT_INTERVAL_S,
) -> str:
    """Wait until pod `namespace/name` has ``spec.nodeName``; return the node name.

    On timeout the error carries the pod's conditions (e.g. the scheduler's "0/3 nodes are
    available: ..." message).
    """
    from kubernetes_asyncio.client import CoreV1Api

    core = CoreV1Api(api)
    seen: list[Any] = []

    async def bound() -> str:
        pod = await core.read_namespaced_pod(name, namespace, _request_timeout=API_TIMEOUT_S)
        seen[:] = [pod]
        return str(pod.spec.node_name or "")

    try:
        return await wait_for(
            bound, timeout=timeout, interval=interval, what=f"pod {namespace}/{name} to be bound"
        )
    except WaitTimeout as exc:
        story = _scheduling_story(seen[0]) if seen else "pod never read"
        raise WaitTimeout(f"{exc}; pod conditions: {story}") from None


async def wait_annotation(
    api: Any,
    *,
    kind: str = "pod",
    name: str,
    key: str,
    namespace: str = "",
    value: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109 - a polling deadline, part of the API
    interval: float = DEFAULT_INTERVAL_S,
) -> str:
    """Wait until a pod (``kind="pod"``, with `namespace`) or node has annotation `key` (= `value` if given).

    Returns the annotation's value; on timeout the error shows the object's annotations.
    """
    from kubernetes_asyncio.client import CoreV1Api

    core = CoreV1Api(api)
    if kind not in ("pod", "node"):
        raise ValueError(f"wait_annotation: kind must be 'pod' or 'node' (got {kind!r})")
    if kind == "pod" and not namespace:
        raise ValueError("wait_annotation: a pod needs a namespace")
    ident = f"{kind} {namespace + '/' if namespace else ''}{name}"

    seen: list[dict[str, str]] = []

    async def present() -> str:
        if kind == "pod":
            meta = (await core.read_namespaced_pod(name, namespace, _request_timeout=API_TIMEOUT_S)).metadata
        else:
            meta = (await core.read_node(name, _request_timeout=API_TIMEOUT_S)).metadata
        annotations = dict(meta.annotations or {})
        seen[:] = [annotations]
        got = annotations.get(key)
        if got is None or (value is not None and got != value):
            return ""
        return str(got)

    want = f"{key}={value!r}" if value is not None else key
    try:
        return await wait_for(
            present, timeout=timeout, interval=interval, what=f"annotation {want} on {ident}"
        )
    except WaitTimeout as exc:
        shown = seen[0] if seen else "object never read"
        raise WaitTimeout(f"{exc}; annotations: {shown}") from None
