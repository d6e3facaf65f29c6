"""The HTTPS server: admissions over real TLS, bad requests, probes, metrics, certificate reload,
and readiness once its supervised certificate watch died."""

from __future__ import annotations

import asyncio
import io
import json
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import builders
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
        "object": builders.pod("p", builders.container("c", gpumem=1000)),
    },
}
BODY_LIMIT = 64 * 1024
CHECK_INTERVAL_S = 0.02


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
        cert_check_interval_s=CHECK_INTERVAL_S,
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
        pytest.param(b'{"kind": "ConfigMap"}', "invalid", id="wrong-kind"),
        pytest.param(b'{"kind": "AdmissionReview", "apiVersion": "v1"}', "invalid", id="wrong-version"),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"object": {}}}',
            "invalid",
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


def reloads(running: Running, result: str) -> float:
    registry = running.server.admitter.telemetry.metrics.registry
    return registry.get_sample_value("hamipy_webhook_certificate_reloads_total", {"result": result}) or 0.0


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` (the watch checks the files on its own clock) for up to 5 s."""
    for _ in range(int(5 / CHECK_INTERVAL_S)):
        if predicate():
            return
        await asyncio.sleep(CHECK_INTERVAL_S)
    pytest.fail(f"timed out waiting for {what}")


async def test_certificate_is_reloaded_when_files_change(running: Running) -> None:
    fresh = bundle()
    write_files(fresh, running.directory)
    await until(lambda: reloads(running, "ok") == 1, "the reload")
    status, _ = await running.request("GET", "/healthz", ca=fresh.ca_pem)
    assert status == 200
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await running.request("GET", "/healthz", ca=running.certs.ca_pem)
    assert "serving certificate reloaded" in running.log.getvalue()


async def test_mismatched_rotation_keeps_the_old_certificate(running: Running) -> None:
    fresh = bundle()
    (running.directory / "tls.crt").write_bytes(fresh.cert_pem)  # key not yet rotated
    await until(lambda: reloads(running, "failed") == 1, "the failed reload")
    status, _ = await running.request("GET", "/healthz")
    assert status == 200
    await asyncio.sleep(5 * CHECK_INTERVAL_S)
    assert reloads(running, "failed") == 1  # reported once, not at every check
    (running.directory / "tls.key").write_bytes(fresh.key_pem)
    await until(lambda: reloads(running, "ok") == 1, "the reload")
    status, _ = await running.request("GET", "/healthz", ca=fresh.ca_pem)
    assert status == 200


async def test_a_dead_certificate_watch_fails_readiness(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> bool:
        raise RuntimeError("injected: the watch broke")

    monkeypatch.setattr(running.server.certificates, "refresh", broken)
    await asyncio.wait_for(running.server.supervisor.failed.wait(), timeout=5)

    failure = "task certificate-watch died: RuntimeError: injected: the watch broke"
    assert running.server.supervisor.failure == failure
    status, body = await running.request("GET", "/readyz")
    assert (status, body.decode()) == (503, f"not ready: {failure}")
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"http://127.0.0.1:{running.server.metrics_port}/readyz") as response,
    ):
        assert (response.status, await response.text()) == (503, f"not ready: {failure}")
    lines = [json.loads(line) for line in running.log.getvalue().splitlines()]
    died = [line for line in lines if line["event"] == "background task died; the service stops"]
    assert [(line["level"], line["task"]) for line in died] == [("error", "certificate-watch")]
    status, _ = await running.request("POST", "/webhook", data=json.dumps(REVIEW).encode())
    assert status == 200  # still answering until the process ends (cli: status 1)


def test_a_handshake_swaps_the_context_and_never_reads_the_files(tmp_path: Path) -> None:
    cert, key, _ = write_files(bundle(), tmp_path)
    store = CertificateStore(cert, key, check_interval_s=3600)
    first = store.current
    write_files(bundle(), tmp_path)
    hello = _FakeSSLObject()
    store._on_hello(hello, None, store.ssl_context)  # type: ignore[arg-type]
    assert store.current is first
    assert hello.context is None
    assert store.refresh()
    assert store.current is not first
    store._on_hello(hello, None, store.ssl_context)  # type: ignore[arg-type]
    assert hello.context is store.current


class _FakeSSLObject:
    context: Any = None


def test_the_check_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cert_check_interval_s must be > 0"):
        ServerSettings(cert_file=tmp_path / "c", key_file=tmp_path / "k", cert_check_interval_s=0)


def test_missing_certificate_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match=r"tls\.crt"):
        CertificateStore(tmp_path / "tls.crt", tmp_path / "tls.key")
