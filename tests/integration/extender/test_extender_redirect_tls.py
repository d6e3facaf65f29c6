"""Followers that redirect to the leader, over TLS, as the chart deploys them (docs/extender.md#replicas):
the extenders' certificate names only the Service, the leader's advertised URL is its IP, and the
real kube-scheduler follows each 307 there because its extender ``tlsConfig.serverName`` is that
Service name. It speaks HTTP/2 to both, as the decision port offers it over TLS."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from builders import container, gpu
from extender_cluster import Cluster, pod_body
from stack_support import elected, extender_config

import hamipy.extender.cli as cli
from hamipy.devcluster import wait_for
from hamipy.devcluster.config import ExtenderTLS
from hamipy.extender.server import ExtenderServer
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.certs import issue_cert, make_ca
from hamipy.kube.client import RawKube
from hamipy.protocol.config import Config

pytestmark = pytest.mark.integration

SERVICE = "ext.hami-system.svc"
DAY = datetime.timedelta(days=1)


@dataclasses.dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path
    scheduler: ExtenderTLS


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """One CA; the replicas' certificate (server and client, the Service's name only, no IP) and
    kube-scheduler's client certificate, as the chart issues them."""
    ca = make_ca("extender-ca", validity=DAY)
    replica = issue_cert(ca, common_name="ext", validity=DAY, dns_names=[SERVICE], server=True, client=True)
    scheduler = issue_cert(ca, common_name="hami-scheduler", validity=DAY, client=True)
    files = {
        "ca.crt": ca.cert_pem,
        "tls.crt": replica.cert_pem,
        "tls.key": replica.key_pem,
        "client.crt": scheduler.cert_pem,
        "client.key": scheduler.key_pem,
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    tls = ExtenderTLS(
        ca_file=str(tmp_path / "ca.crt"),
        cert_file=str(tmp_path / "client.crt"),
        key_file=str(tmp_path / "client.key"),
        server_name=SERVICE,
    )
    return Pki(tmp_path / "ca.crt", tmp_path / "tls.crt", tmp_path / "tls.key", tls)


@pytest.fixture
async def replicas(kube_client: Any, namespace: str, pki: Pki) -> AsyncIterator[list[ExtenderServer]]:
    settings = dataclasses.replace(elected(namespace), follower_redirect=True, peer_server_name=SERVICE)
    servers = []
    try:
        for i in range(3):
            server = ExtenderServer(
                config=Config(),
                settings=dataclasses.replace(settings, identity=f"replica-{i}"),
                telemetry=Telemetry.create(stream=io.StringIO()),
                api=RawKube(kube_client),
                ssl_context=cli.server_tls(pki.cert, pki.key, pki.ca),
            )
            await server.start()
            servers.append(server)
        for server in servers:
            await server.wait_synced(30)
        yield servers
    finally:
        for server in servers:
            await server.stop()


def redirected(servers: list[ExtenderServer], verb: str) -> float:
    labels = {"verb": verb, "result": "redirected"}
    return sum(
        s.telemetry.metrics.registry.get_sample_value("hamipy_extender_forwarded_total", labels) or 0.0
        for s in servers
    )


def connections(server: ExtenderServer) -> tuple[float, float]:
    """Connections the decision port accepted, and of those the ones that chose HTTP/2."""
    registry, labels = server.telemetry.metrics.registry, {"server": "api"}
    accepted = registry.get_sample_value("hamipy_extender_http_connections_accepted_total", labels)
    http2 = registry.get_sample_value("hamipy_extender_http_connections_http2_total", labels)
    return accepted or 0.0, http2 or 0.0


@pytest.mark.timeout(180)
async def test_kube_scheduler_follows_a_followers_redirect_to_the_leader_over_tls(
    cluster: Cluster, replicas: list[ExtenderServer], pki: Pki, hami_scheduler: Callable[..., Any]
) -> None:
    ns = cluster.namespace
    leader = await wait_for(
        lambda: next((s for s in replicas if s.leadership.exclusive()), None),
        timeout=30,
        what="an extender leader caught up",
    )
    follower = next(s for s in replicas if s is not leader)
    assert follower.url.startswith("https://127.0.0.1:")  # not a name the certificate carries
    await asyncio.to_thread(
        hami_scheduler, dataclasses.replace(extender_config(follower.url), tls=pki.scheduler)
    )
    await cluster.add_node("n", [gpu(f"GPU-{ns}-{i}", i, count=4) for i in range(2)])
    names = [f"p{i}" for i in range(6)]
    for name in names:
        await cluster.create(pod_body(name, container(gpu=1, gpumem=1000), selector=ns))
    for name in names:
        await cluster.bound(name, timeout=60)
    followers = [s for s in replicas if s is not leader]
    assert redirected(followers, "filter") >= len(names)
    assert redirected(followers, "bind") >= len(names)
    # kube-scheduler's Go client chose HTTP/2 on every connection, to the follower and the leader.
    assert leader is not None
    for replica in (follower, leader):
        accepted, http2 = connections(replica)
        assert accepted >= 1
        assert http2 == accepted
    await cluster.assert_invariant()
