"""``api_client`` resolves the proxy for the API server once and never looks at the environment per
request (aiohttp's ``trust_env`` read ``*_PROXY`` and ``~/.netrc`` in a thread on every call)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hamipy.kube.client import MAX_CONNECTIONS, api_client, connect

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://10.1.2.3:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy")


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    return str(path)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"HTTPS_PROXY": "http://proxy.example:3128"}, "http://proxy.example:3128"),
        ({"https_proxy": "http://proxy.example:3128", "no_proxy": "10.1.2.3"}, None),
        ({"HTTP_PROXY": "http://proxy.example:3128"}, None),  # the API server is https
    ],
)
async def test_the_proxy_is_resolved_once_and_the_session_trusts_no_environment(
    kubeconfig: str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str | None
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    api = await api_client(kubeconfig)
    try:
        assert api.rest_client.proxy == expected
        session = api.rest_client.pool_manager
        assert session.trust_env is False
        assert not session.closed
        assert session.connector is not None
        assert not session.connector.closed
    finally:
        await api.close()
    assert api.rest_client.pool_manager.connector is None  # closed with the client, not leaked


@pytest.mark.parametrize(("kwargs", "limit"), [({}, MAX_CONNECTIONS), ({"max_connections": 4}, 4)])
async def test_connections_to_the_api_server_are_capped(
    kubeconfig: str, kwargs: dict[str, int], limit: int
) -> None:
    """kubernetes-asyncio's pool of 100 let bursts open connections whose TLS buffers stayed (the
    extender's RSS crept up under churn); the pool is capped, and a request waits for a slot."""
    api = await api_client(kubeconfig, **kwargs)
    try:
        assert api.rest_client.pool_manager.connector.limit == limit
    finally:
        await api.close()


async def test_connect_passes_its_cap_on_and_refuses_a_cap_below_one(kubeconfig: str) -> None:
    """The extender sizes its own pool (``--api-connections``): every bind in flight holds one."""
    api, raw = await connect(kubeconfig, max_connections=7)
    try:
        assert api.rest_client.pool_manager.connector.limit == 7
        assert raw.api_client is api
    finally:
        await api.close()
    with pytest.raises(ValueError, match="at least 1"):
        await api_client(kubeconfig, max_connections=0)
