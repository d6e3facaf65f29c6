"""Only kube-scheduler calls the extender: over real TLS, the decision port takes a request only
with a client certificate the configured CA signed, while probes and metrics answer on a plain port
of their own (docs/security.md, rule 5)."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from builders import container, gpu_node, gpu_pod
from extender_fakes import elected
from http2_client import H2Client
from prometheus_client import CONTENT_TYPE_LATEST

import hamipy.extender.cli as cli
from hamipy.extender.leadership import Leadership
from hamipy.extender.model import ClusterModel
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.certs import KeyPair, issue_cert, make_ca
from hamipy.kube.client import NullKube
from hamipy.protocol.config import Config
from hamipy.protocol.settings import settings_from

DAY = datetime.timedelta(days=1)
MAX_BODY = 64 * 1024


@dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path
    client: ssl.SSLContext
    """kube-scheduler's: trusts the extender's CA, presents the client certificate."""
    stranger: ssl.SSLContext
    """Trusts the extender's CA, presents a certificate of another CA."""
    anonymous: ssl.SSLContext
    """Trusts the extender's CA, presents no certificate."""


def _write(directory: Path, name: str, pair: KeyPair) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    cert.write_bytes(pair.cert_pem)
    key.write_bytes(pair.key_pem)
    return cert, key


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = make_ca("extender-ca", validity=DAY)
    other = make_ca("another-ca", validity=DAY)
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    cert, key = _write(
        tmp_path,
        "server",
        issue_cert(ca, common_name="ext", validity=DAY, ip_addresses=["127.0.0.1"], server=True),
    )
    contexts = []
    for name, signer in (("scheduler", ca), ("stranger", other), ("anonymous", None)):
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        if signer is not None:
            pair = issue_cert(signer, common_name=name, validity=DAY, client=True)
            context.load_cert_chain(*_write(tmp_path, name, pair))
        contexts.append(context)
    return Pki(tmp_path / "ca.crt", cert, key, *contexts)


def tls_server(pki: Pki, settings: ExtenderSettings, *, metrics_port: int | None = None) -> ExtenderServer:
    """An extender without the cluster, serving over TLS and demanding the scheduler's certificate."""
    return ExtenderServer(
        config=Config(),
        settings=settings,
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=NullKube(),
        ssl_context=cli.server_tls(pki.cert, pki.key, pki.ca),
        metrics_port=metrics_port,
    )


@pytest.fixture
async def server(pki: Pki) -> AsyncIterator[ExtenderServer]:
    srv = tls_server(pki, ExtenderSettings(max_body_bytes=MAX_BODY), metrics_port=0)
    async with srv:
        srv.model.replace_nodes([gpu_node("a")])
        srv.model.replace_pods([])
        yield srv


async def _filter(srv: ExtenderServer, context: ssl.SSLContext) -> int:
    body = {"Pod": gpu_pod("p", container(gpu=1, gpumem=1000)), "NodeNames": ["a"]}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.post(f"{srv.url}/filter", json=body, ssl=context) as resp,
    ):
        return resp.status


async def test_the_decision_port_takes_only_the_schedulers_certificate(
    server: ExtenderServer, pki: Pki
) -> None:
    assert server.url.startswith("https://")
    assert await _filter(server, pki.client) == 200
    for context in (pki.anonymous, pki.stranger):
        with pytest.raises(aiohttp.ClientError):
            await _filter(server, context)
    # Refused callers cost nothing lasting: the scheduler still gets in.
    assert await _filter(server, pki.client) == 200


async def test_probes_and_metrics_answer_on_their_own_plain_port(server: ExtenderServer) -> None:
    assert server.metrics_port
    base = f"http://{server.host}:{server.metrics_port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for path, expect in (("/healthz", "ok"), ("/readyz", "ok"), ("/metrics", "hamipy_extender_")):
            async with session.get(base + path) as resp:
                assert resp.status == 200, path
                assert expect in await resp.text()
        # The decision routes are not on it.
        async with session.post(base + "/filter", json={}) as resp:
            assert resp.status in (404, 405)


async def test_over_http2_the_decision_port_answers_as_over_http1(server: ExtenderServer, pki: Pki) -> None:
    """kube-scheduler's Go client chooses HTTP/2 when offered: the same answers, on one connection."""
    filter_body = json.dumps({"Pod": gpu_pod("p", container(gpu=1, gpumem=1000)), "NodeNames": ["a"]})
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.post(f"{server.url}/filter", data=filter_body, ssl=pki.client) as resp,
    ):
        over_http1 = await resp.read()
    h2c = await H2Client.connect(server.port, pki.client)
    try:
        answer = await h2c.request("POST", "/filter", filter_body.encode())
        assert (answer.status, answer.body) == (200, over_http1)
        assert json.loads(answer.body)["NodeNames"] == ["a"]
        assert answer.headers["content-type"] == "application/json"
        bad = await h2c.request("POST", "/filter", b"{not json")
        assert bad.status == 400
        assert "JSON" in json.loads(bad.body)["Error"]
        too_large = await h2c.request("POST", "/bind", b" " * (MAX_BODY + 1))
        assert too_large.status == 400
        assert json.loads(too_large.body)["Error"] == f"request body larger than {MAX_BODY} bytes"
        assert (await h2c.request("GET", "/filter")).status == 405
        assert (await h2c.request("GET", "/nothing")).status == 404
        ready = await h2c.request("GET", "/readyz")
        assert (ready.status, ready.body) == (200, b"ok")
        metrics = await h2c.request("GET", "/metrics")
        assert b'hamipy_extender_http_connections_http2_total{server="api"} 1.0' in metrics.body
    finally:
        await h2c.close()
    bad_requests = {"verb": "filter", "result": "bad-request", "reason": "BadRequest"}
    assert (
        server.telemetry.metrics.registry.get_sample_value("hamipy_extender_decisions_total", bad_requests)
        == 1
    )


_COMPARED_HEADERS = ("content-type", "content-length", "allow", "location")
Reply = tuple[int, bytes, dict[str, str]]


async def _over_http1(
    server: ExtenderServer, context: ssl.SSLContext, method: str, path: str, body: bytes
) -> Reply:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.request(method, server.url + path, data=body, ssl=context, allow_redirects=False) as resp,
    ):
        headers = {name: resp.headers[name] for name in _COMPARED_HEADERS if name in resp.headers}
        return resp.status, await resp.read(), headers


async def _over_http2(h2c: H2Client, method: str, path: str, body: bytes) -> Reply:
    answer = await h2c.request(method, path, body)
    headers = {name: answer.headers[name] for name in _COMPARED_HEADERS if name in answer.headers}
    return answer.status, answer.body, headers


async def test_every_route_answers_alike_over_http1_and_http2(server: ExtenderServer, pki: Pki) -> None:
    """One route table for both protocols: each path and method, known or not, gets the same status,
    body and headers over HTTP/1.1 as over HTTP/2."""
    args = json.dumps({"Pod": gpu_pod("p", container(gpu=1, gpumem=1000)), "NodeNames": ["a"]}).encode()
    calls = [
        *(("POST", f"/{verb}", args) for verb in ("filter", "prioritize", "preempt")),
        ("POST", "/filter", b"{not json"),
        ("POST", "/bind", b'{"PodName": 1}'),
        ("POST", "/bind", b" " * (MAX_BODY + 1)),
        *((method, path, b"") for method in ("GET", "HEAD") for path in ("/healthz", "/readyz", "/metrics")),
        ("GET", "/filter", b""),
        ("HEAD", "/bind", b""),
        ("POST", "/healthz", b"{}"),
        ("GET", "/nothing", b""),
        ("DELETE", "/", b""),
    ]
    over_http1 = [await _over_http1(server, pki.client, *call) for call in calls]
    h2c = await H2Client.connect(server.port, pki.client)  # offers h2 alone from here on
    try:
        over_http2 = [await _over_http2(h2c, *call) for call in calls]
    finally:
        await h2c.close()
    for call, one, two in zip(calls, over_http1, over_http2, strict=True):
        if call[1] == "/metrics":  # the counters move between scrapes; what is exported does not
            assert one[2]["content-type"] == two[2]["content-type"] == CONTENT_TYPE_LATEST
            assert call[0] == "HEAD" or int(two[2]["content-length"]) == len(two[1]) > 0
            one, two = (one[0], _families(one[1]), {}), (two[0], _families(two[1]), {})
        assert one == two, call


def _families(exposition: bytes) -> bytes:
    return b"\n".join(line for line in exposition.splitlines() if line.startswith(b"# TYPE"))


async def test_with_no_http2_the_decision_port_offers_http1_only(pki: Pki) -> None:
    srv = tls_server(pki, ExtenderSettings(http2=False))
    async with srv:
        pki.client.set_alpn_protocols(["h2", "http/1.1"])
        _, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=pki.client)
        try:
            assert writer.get_extra_info("ssl_object").selected_alpn_protocol() in (None, "http/1.1")
        finally:
            writer.close()
    args = cli.build_parser({}).parse_args(["serve", "--no-http2"])
    assert not settings_from(ExtenderSettings, args).http2
    assert settings_from(ExtenderSettings, cli.build_parser({}).parse_args(["serve"])).http2


def test_tls_flags_that_do_not_go_together_are_refused(pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.server_tls(None, None, None) is None
    with pytest.raises(ValueError, match="needs --tls-cert-file"):
        cli.server_tls(None, None, pki.ca)
    with pytest.raises(ValueError, match="go together"):
        cli.server_tls(pki.cert, None, None)
    assert cli.server_tls(pki.cert, pki.key, None).verify_mode == ssl.CERT_NONE  # type: ignore[union-attr]
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--tls-client-ca-file", str(pki.ca)], env={})
    assert exited.value.code == 2
    assert "--tls-client-ca-file needs --tls-cert-file" in capsys.readouterr().err


async def test_a_follower_forwards_to_the_leader_over_tls_with_its_own_certificate(
    pki: Pki, tmp_path: Path
) -> None:
    """As the chart deploys replicas: each serves with a certificate of the one CA that is good for
    server and client, names the Service; a follower checks the leader's as that name
    (``--peer-server-name``) and presents its own, which the leader's client-CA check accepts."""
    ca = make_ca("extender-ca", validity=DAY)
    (tmp_path / "replicas-ca.crt").write_bytes(ca.cert_pem)
    pair = issue_cert(
        ca,
        common_name="ext",
        validity=DAY,
        dns_names=["ext.hami.svc"],
        ip_addresses=["127.0.0.1"],
        server=True,
        client=True,
    )
    cert, key = _write(tmp_path, "replica", pair)
    replica_ca = tmp_path / "replicas-ca.crt"
    leader = ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=NullKube(),
        ssl_context=cli.server_tls(cert, key, replica_ca),
    )
    async with leader:
        leader.model.replace_nodes([gpu_node("a")])
        leader.model.replace_pods([])
        settings = ExtenderSettings(leader_election=True, advertise_url="https://127.0.0.1:1")
        follower = Leadership(
            election=True,
            elector=elected(leader_url=leader.url),
            api=NullKube(),
            model=ClusterModel(),
            telemetry=Telemetry.create(stream=io.StringIO()),
            forward_ssl=cli.peer_tls(settings, cert, key, replica_ca),
            forward_server_name="ext.hami.svc",
        )
        try:
            body = json.dumps({"Pod": gpu_pod("p", container(gpu=1, gpumem=1000)), "NodeNames": ["a"]})
            answer = await follower.forward("/filter", body.encode())
        finally:
            await follower.close()
    assert answer.status == 200, answer.body
    assert json.loads(answer.body)["NodeNames"] == ["a"]
