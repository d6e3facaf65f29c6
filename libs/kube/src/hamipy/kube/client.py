"""The API server, as every service reaches it: raw JSON over kubernetes-asyncio's ``ApiClient``.

Objects stay plain dicts: decoding 10,000 pods into generated models would cost more than what the
services do with them. ``KubeApi`` is the small interface everything else is built on, so a test can
hand in a fake; ``RawKube`` implements it over an ``ApiClient`` (which supplies the server, the
certificates and the token); ``NullKube`` is the client of the no-API mode, with no cluster behind
it. Answers and watch events are decoded by msgspec, in under half the
standard library's time: a service's watches decode every pod the cluster writes. Every call has a
timeout; every failure comes out as a ``hamipy.kube.errors.KubeError``.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, Protocol

import aiohttp
import msgspec

from hamipy.kube.errors import KubeError, NotFound, error_for

__all__ = [
    "API_TIMEOUT_S",
    "JSON",
    "JSON_PATCH",
    "MERGE_PATCH",
    "STRATEGIC_MERGE_PATCH",
    "KubeApi",
    "NullKube",
    "Query",
    "RawKube",
    "api_client",
    "connect",
]

API_TIMEOUT_S: Final = 10.0
"""Default per call: the API server answers in milliseconds; 10 s covers a busy one."""
JSON: Final = "application/json"
MERGE_PATCH: Final = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH: Final = "application/strategic-merge-patch+json"
JSON_PATCH: Final = "application/json-patch+json"
MAX_CONNECTIONS: Final = 64
"""Connections to the API server at once per client (``--api-connections``): its watches plus the
calls in flight. A cap, not a pool: a node agent's few calls open a few. The extender holds one per
bind in flight for its Binding while kube-scheduler sends binds in parallel; with too few, binds
wait here for a connection, each holding one of kube-scheduler's connections to us meanwhile, and a
burst behind a slow API server fills the extender's own connection cap. With 64 the binds of a
1,000-pod burst at 1,000 nodes do not queue for a connection, for a few MiB of TLS buffers more
(docs/benchmarks.md#the-extenders-api-connections). kubernetes-asyncio's default of 100 lets a
burst open more, each keeping TLS buffers that the allocator never hands back; beyond the cap a
request waits for a connection, inside its own timeout."""
CONNECT_TIMEOUT_S: Final = 30.0
"""A watch's connection timeout (its reads time out after the caller's inactivity limit)."""
_LINE_LIMIT: Final = 32 * 1024 * 1024
"""Longest single watch event accepted (an object is at most ~1.5 MiB in etcd)."""
_decode: Final = msgspec.json.decode
_encode: Final = msgspec.json.encode
_NOT_JSON: Final = (ValueError, RecursionError)
"""msgspec.DecodeError, a string that is not UTF-8, or nesting past the parser's depth."""

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
        content_type: str = JSON,
        timeout_s: float = API_TIMEOUT_S,
    ) -> Any:
        """One call; the decoded JSON answer. Raises ``KubeError`` (``NotFound``, ``Conflict``...)."""
        ...

    def stream(self, path: str, *, query: Query, inactivity_s: float) -> AsyncIterator[dict[str, Any]]:
        """A watch: one decoded JSON object per line until the server ends it; a stream silent for
        ``inactivity_s`` raises ``KubeError``."""
        ...


class NullKube:
    """``KubeApi`` with no cluster behind it: the no-API mode (benchmarks and unit tests that feed
    the extender's model themselves), handed to the parts that take a client so that none of them
    tests for a missing one. A write is accepted and goes nowhere (answered ``{}``: an Event is
    recorded, never written, and no drop counted); a read finds nothing (``NotFound``); a watch
    ends at once, delivering nothing."""

    async def request(self, method: str, path: str, **_: Any) -> Any:
        if method == "GET":
            raise NotFound(f"GET {path}: no cluster behind this client (NullKube)", status=404)
        return {}

    async def stream(self, path: str, *, query: Query, inactivity_s: float) -> AsyncIterator[dict[str, Any]]:
        nothing: tuple[dict[str, Any], ...] = ()
        for event in nothing:
            yield event


async def api_client(kubeconfig: str | None = None, *, max_connections: int = MAX_CONNECTIONS) -> Any:
    """A kubernetes-asyncio ``ApiClient`` (the caller closes it): from ``kubeconfig`` when given,
    else the pod's service account (in cluster), else ``~/.kube/config``; ``KubeError`` when there
    is none to be read. Each client gets its own configuration, so two in one process never share
    credentials. At most ``max_connections`` are open to the server at once."""
    from kubernetes_asyncio import client, config

    if max_connections < 1:  # aiohttp would read 0 as no limit at all
        raise ValueError(f"connections to the API server must be at least 1 (got {max_connections})")
    configuration = client.Configuration()
    configuration.connection_pool_maxsize = max_connections
    try:
        if kubeconfig:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except config.ConfigException:
                await config.load_kube_config(client_configuration=configuration)
    except (config.ConfigException, OSError) as exc:
        where = kubeconfig or "the service account or ~/.kube/config"
        raise KubeError(f"no Kubernetes API configuration in {where}: {exc}") from exc
    api = client.ApiClient(configuration)
    _settle_environment(api)
    return api


def _settle_environment(api: Any) -> None:
    """Read the proxy variables once, not per request.

    kubernetes-asyncio's session trusts the environment, so aiohttp looks up ``*_PROXY`` and parses
    ``~/.netrc`` in a worker thread on *every* request, a cost on the extender's bind path for
    answers that cannot change while the process runs. The proxy that applies to the API server
    (``HTTPS_PROXY``/``NO_PROXY``) is resolved here, and the session is replaced by
    one on the same connector that does not look again. (A netrc login is never how a cluster
    authenticates: the client sends its token or certificate.)"""
    rest = api.rest_client
    if not rest.proxy:
        url = urllib.parse.urlsplit(api.configuration.host)
        proxy = urllib.request.getproxies().get(url.scheme or "https")
        if proxy and url.hostname and not urllib.request.proxy_bypass(url.hostname):
            rest.proxy = proxy
    old: aiohttp.ClientSession = rest.pool_manager
    rest.pool_manager = aiohttp.ClientSession(
        connector=old.connector,
        trust_env=False,
        read_bufsize=2**21,  # as kubernetes-asyncio's: a watch event may be ~1.5 MiB
    )
    old.detach()  # the connector now belongs to the new session


class RawKube:
    """``KubeApi`` over a kubernetes-asyncio ``ApiClient`` (the caller owns and closes it).

    A call is sent on the client's own aiohttp session, with its server, default headers, token
    (``update_params_for_auth``, as ``call_api`` applies it: a rotated token is read), proxy and TLS
    settings, but not through its generic ``call_api``: for a plain JSON body that layer copies the
    body and headers through ``sanitize_for_serialization`` and encodes with ``json.dumps``, a large
    share of each call's CPU on the extender's bind path (msgspec encodes here)."""

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
    ) -> aiohttp.ClientResponse:
        api = self.api_client
        headers = {"Accept": JSON, "Content-Type": content_type, **api.default_headers}
        if api.cookie:
            headers["Cookie"] = api.cookie
        queries = list(query)
        await api.update_params_for_auth(headers, queries, ["BearerToken"])
        url = api.configuration.host + path
        if queries:
            url += "?" + urllib.parse.urlencode(queries)
        rest = api.rest_client
        extra: dict[str, Any] = {}
        if rest.proxy:
            extra["proxy"] = rest.proxy
        if rest.proxy_headers:
            extra["proxy_headers"] = rest.proxy_headers
        if rest.server_hostname:
            extra["server_hostname"] = rest.server_hostname
        session: aiohttp.ClientSession = rest.pool_manager
        return await session.request(
            method,
            url,
            data=None if body is None else _encode(body),
            headers=headers,
            timeout=client_timeout,
            **extra,
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Query = (),
        body: Any = None,
        content_type: str = JSON,
        timeout_s: float = API_TIMEOUT_S,
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
            raise error_for(resp.status, what, data)
        try:
            return _decode(data) if data else None
        except _NOT_JSON as exc:
            raise KubeError(f"{what}: the answer is not JSON: {exc}", status=resp.status) from exc

    async def stream(self, path: str, *, query: Query, inactivity_s: float) -> AsyncIterator[dict[str, Any]]:
        what = f"WATCH {path}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=inactivity_s)
        try:
            resp = await self._call("GET", path, query, None, JSON, timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        try:
            if resp.status != 200:
                raise error_for(resp.status, what, await resp.read())
            buffer = b""
            try:
                # Chunks, not `async for line in resp.content`: its line limit (64 KiB) is below a pod.
                async for chunk in resp.content.iter_any():
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    for index, line in enumerate(lines):
                        if index:
                            # A chunk carries a burst of events: let the requests that arrived
                            # meanwhile in between them, not after the whole burst.
                            await asyncio.sleep(0)
                        if line.strip():
                            yield _decode(line)
                    if len(buffer) > _LINE_LIMIT:
                        raise KubeError(f"{what}: event longer than {_LINE_LIMIT} bytes")
            except (aiohttp.ClientError, TimeoutError, *_NOT_JSON) as exc:
                raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc
        finally:
            resp.release()


async def connect(
    kubeconfig: str | None = None, *, max_connections: int = MAX_CONNECTIONS
) -> tuple[Any, RawKube]:
    """``api_client(kubeconfig, max_connections=...)`` and a ``RawKube`` over it (close the client
    when done)."""
    client = await api_client(kubeconfig, max_connections=max_connections)
    return client, RawKube(client)
