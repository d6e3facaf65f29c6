"""The HTTPS server: admissions over real TLS, bad requests, probes, metrics, certificate reload."""

from __future__ import annotations

import asyncio
import io
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from hamipy.webhook.admitting import Admitter
from hamipy.webhook.certs import CertificateBundle, generate_certificates, write_files
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.server import CertificateError, CertificateStore, ServerSettings, WebhookServer, make_app
from hamipy.webhook.telemetry import Telemetry

REVIEW = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "request": {
        "uid": "u-42",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE",
        "namespace": "ns",
        "object": {
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpumem": "1000"}}}]},
        },
    },
}
BODY_LIMIT = 64 * 1024


def bundle() -> CertificateBundle:
    return generate_certificates(dns_names=["localhost"], ip_addresses=["127.0.0.1"])


def client_context(ca_pem: bytes) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=ca_pem.decode())


def new_admitter() -> tuple[Admitter, io.StringIO]:
    log = io.StringIO()
    return Admitter(MutationSettings(), Telemetry.create(stream=log)), log


class Running:
    def __init__(
        self, server: WebhookServer, certs: CertificateBundle, directory: Path, log: io.StringIO
    ) -> None:
        self.server = server
        self.certs = certs
        self.directory = directory
        self.log = log

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server.port}"

    async def request(
        self, method: str, path: str, *, data: bytes | None = None, ca: bytes | None = None
    ) -> tuple[int, bytes]:
        connector = aiohttp.TCPConnector(ssl=client_context(ca or self.certs.ca_pem), force_close=True)
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.request(method, self.url + path, data=data) as response,
        ):
            return response.status, await response.read()


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    certs = bundle()
    cert, key, _ = write_files(certs, tmp_path)
    admitter, log = new_admitter()
    settings = ServerSettings(
        cert_file=cert,
        key_file=key,
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        max_body_bytes=BODY_LIMIT,
        cert_check_interval_s=0.0,
        shutdown_timeout_s=1.0,
    )
    async with WebhookServer(settings, admitter) as server:
        yield Running(server, certs, tmp_path, log)


async def test_admission_over_tls(running: Running) -> None:
    status, body = await running.request("POST", "/webhook", data=json.dumps(REVIEW).encode())
    assert status == 200
    doc = json.loads(body)
    assert doc["response"]["uid"] == "u-42"
    assert doc["response"]["allowed"] is True
    assert doc["response"]["patchType"] == "JSONPatch"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(b"<html>", "not_json", id="not-json"),
        pytest.param(b'{"kind": "ConfigMap"}', "wrong_kind", id="wrong-kind"),
        pytest.param(b'{"kind": "AdmissionReview", "apiVersion": "v1"}', "wrong_version", id="wrong-version"),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"object": {}}}',
            "no_uid",
            id="missing-uid",
        ),
        pytest.param(b"x" * (BODY_LIMIT + 1), "too_large", id="over-limit"),
    ],
)
async def test_bad_requests_get_400_and_the_server_keeps_serving(
    running: Running, body: bytes, reason: str
) -> None:
    status, raw = await running.request("POST", "/webhook", data=body)
    assert status == 400
    answer = json.loads(raw)
    assert answer["error"] == reason
    assert answer["message"]
    metrics = running.server.admitter.telemetry.metrics.registry
    assert metrics.get_sample_value("hamipy_webhook_bad_requests_total", {"reason": reason}) == 1
    assert any(json.loads(line).get("reason") == reason for line in running.log.getvalue().splitlines())
    status, _ = await running.request("POST", "/webhook", data=json.dumps(REVIEW).encode())
    assert status == 200


async def test_get_on_webhook_is_not_allowed(running: Running) -> None:
    status, _ = await running.request("GET", "/webhook")
    assert status == 405


async def test_probes_and_metrics_on_both_ports(running: Running) -> None:
    await running.request("POST", "/webhook", data=json.dumps(REVIEW).encode())
    for path in ("/healthz", "/readyz"):
        status, _ = await running.request("GET", path)
        assert status == 200
    status, body = await running.request("GET", "/metrics")
    assert status == 200
    assert b'hamipy_webhook_admissions_total{outcome="mutated",reason="patched"} 1.0' in body
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"http://127.0.0.1:{running.server.metrics_port}/metrics") as response,
    ):
        assert response.status == 200
        assert b"hamipy_webhook_admission_duration_seconds_bucket" in await response.read()


async def test_readyz_fails_until_ready() -> None:
    admitter, _ = new_admitter()
    ready = asyncio.Event()
    async with TestClient(TestServer(make_app(admitter, ready=ready))) as client:
        assert (await client.get("/readyz")).status == 503
        assert (await client.get("/healthz")).status == 200
        ready.set()
        assert (await client.get("/readyz")).status == 200


async def test_certificate_is_reloaded_when_files_change(running: Running) -> None:
    fresh = bundle()
    write_files(fresh, running.directory)
    status, _ = await running.request("GET", "/healthz", ca=fresh.ca_pem)
    assert status == 200
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await running.request("GET", "/healthz", ca=running.certs.ca_pem)
    registry = running.server.admitter.telemetry.metrics.registry
    assert registry.get_sample_value("hamipy_webhook_certificate_reloads_total", {"result": "ok"}) == 1


async def test_mismatched_rotation_keeps_the_old_certificate(running: Running) -> None:
    fresh = bundle()
    (running.directory / "tls.crt").write_bytes(fresh.cert_pem)  # key not yet rotated
    status, _ = await running.request("GET", "/healthz")
    assert status == 200
    registry = running.server.admitter.telemetry.metrics.registry
    assert registry.get_sample_value("hamipy_webhook_certificate_reloads_total", {"result": "failed"}) == 1
    (running.directory / "tls.key").write_bytes(fresh.key_pem)
    status, _ = await running.request("GET", "/healthz", ca=fresh.ca_pem)
    assert status == 200


def test_reload_is_checked_at_most_once_per_interval(tmp_path: Path) -> None:
    cert, key, _ = write_files(bundle(), tmp_path)
    store = CertificateStore(cert, key, check_interval_s=3600)
    first = store.current
    write_files(bundle(), tmp_path)
    store._on_hello(_FakeSSLObject(), None, store.ssl_context)  # type: ignore[arg-type]
    assert store.current is first
    assert store.refresh()
    assert store.current is not first


class _FakeSSLObject:
    context: Any = None


def test_missing_certificate_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match=r"tls\.crt"):
        CertificateStore(tmp_path / "tls.crt", tmp_path / "tls.key")
