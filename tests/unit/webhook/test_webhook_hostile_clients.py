"""The webhook against clients that are not the API server: slow or silent TLS clients are cut while
the probes keep answering, malformed bodies get HTTP 400 and malformed pods a refusal with code 400
(never a 500); the limits come from flags and the environment."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import builders
import connection_metrics
import pytest

import hamipy.webhook.cli as cli
from hamipy.devcluster.waiting import wait_for
from hamipy.protocol.settings import settings_from
from hamipy.serving.http_limits import HttpLimits
from hamipy.webhook.admitting import Admitter
from hamipy.webhook.certs import CertificateBundle, generate_certificates, write_files
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.server import ServerSettings, WebhookServer
from hamipy.webhook.telemetry import Telemetry

GPU_POD = builders.pod("p", builders.container("c", gpu=1), namespace="ns", annotations={"team": "ml"})
TRICKLE_S = 0.2


def review(pod: object, **request: Any) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "namespace": "ns",
            "object": pod,
            **request,
        },
    }


class Running:
    def __init__(self, server: WebhookServer, certs: CertificateBundle) -> None:
        self.server = server
        self.certs = certs

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cadata=self.certs.ca_pem.decode())

    async def request(self, method: str, path: str, data: bytes | None = None) -> tuple[int, bytes]:
        connector = aiohttp.TCPConnector(ssl=self.client_context(), force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.request(method, f"https://127.0.0.1:{self.server.port}{path}", data=data) as response,
        ):
            return response.status, await response.read()

    async def admit(self, doc: object) -> tuple[int, dict[str, Any]]:
        status, body = await self.request("POST", "/webhook", json.dumps(doc).encode())
        return status, json.loads(body)

    async def open_tls(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.wait_for(
            asyncio.open_connection(
                "127.0.0.1", self.server.port, ssl=self.client_context(), server_hostname="127.0.0.1"
            ),
            5,
        )

    def closed(self, server: str) -> dict[str, float]:
        """``hamipy_webhook_http_connections_closed_total`` of one port, by reason."""
        return connection_metrics.closed(
            self.server.admitter.telemetry.metrics.registry, "hamipy_webhook", server
        )

    async def probe(self) -> int:
        url = f"http://127.0.0.1:{self.server.metrics_port}/healthz"
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(url) as response,
        ):
            return response.status


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, log: io.StringIO, *, timeout_s: float, keepalive_s: float, max_connections: int
) -> AsyncIterator[Running]:
    """The webhook on free ports, ``timeout_s`` its header and body timeouts, logging to ``log``."""
    certs = generate_certificates(dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    cert, key, _ = write_files(certs, tmp_path)
    settings = ServerSettings(
        cert_file=cert,
        key_file=key,
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        shutdown_timeout_s=1.0,
        limits=HttpLimits(
            header_timeout_s=timeout_s,
            body_timeout_s=timeout_s,
            keepalive_timeout_s=keepalive_s,
            max_connections=max_connections,
        ),
    )
    admitter = Admitter(MutationSettings(), Telemetry.create(stream=log))
    async with WebhookServer(settings, admitter) as server:
        yield Running(server, certs)


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    async with serving(tmp_path, io.StringIO(), timeout_s=0.5, keepalive_s=5, max_connections=4) as running:
        yield running


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection (at most 5 s of waiting)."""
    try:
        return await asyncio.wait_for(reader.read(), 5)
    except (ConnectionResetError, ssl.SSLError):
        return b""


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(TRICKLE_S)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 5)


# -- slow and silent clients ------------------------------------------------------------------------------


async def test_silent_tls_clients_are_cut_while_probes_and_admissions_go_on(running: Running) -> None:
    port = running.server.port
    silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(6)]  # over the cap of 4
    started = time.monotonic()
    assert await running.probe() == 200  # the plain port has its own cap
    status, answer = await running.admit(review(GPU_POD))  # gets in by evicting the longest waiter
    assert (status, answer["response"]["allowed"]) == (200, True)
    for reader, _ in silent:
        assert await closed_by_server(reader) == b""
    assert time.monotonic() - started < 3  # the header timeout (0.5 s), not asyncio's 60 s handshake
    for _, writer in silent:
        await close(writer)
    assert await running.probe() == 200
    # Exported per port: the TLS port cut the silent clients; the probe port cut nobody.
    closed = running.closed("api")
    assert closed["evicted"] + closed["header_timeout"] == 6
    assert closed["evicted"] >= 2
    assert set(running.closed("probes").values()) == {0}


STALLED_HEAD = (
    b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n{"
)
"""A request whose body then stops: a byte a second, or none, is the same to the server."""
STALLED_PROBE = b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n{"
"""The same at the probe port, whose handlers read no body (answered, then the body is drained)."""


async def test_stalled_bodies_past_the_cap_hold_off_neither_probes_nor_admissions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Timeouts far past the clients' own: only the cap decides who gets in.
    log = io.StringIO()
    async with serving(tmp_path, log, timeout_s=60, keepalive_s=60, max_connections=4) as running:
        stalled = []
        for _ in range(12):  # three times the cap on each port
            _, writer = await running.open_tls()
            writer.write(STALLED_HEAD)
            await writer.drain()
            stalled.append(writer)
            _, writer = await asyncio.open_connection("127.0.0.1", running.server.metrics_port)
            writer.write(STALLED_PROBE)
            await writer.drain()
            stalled.append(writer)
        # The kubelet's probes (on their own port) and the API server's calls (on the TLS port)
        # are answered within their clients' timeouts (10 s: the chart's timeoutSeconds), not after
        # the stalled bodies' 60 s.
        assert await running.probe() == 200
        assert await running.request("GET", "/healthz") == (200, b"ok")
        status, answer = await running.admit(review(GPU_POD))
        assert (status, answer["response"]["allowed"]) == (200, True)
        assert running.closed("api")["body_timeout"] == running.closed("probes")["body_timeout"] == 0
        # The clients leave mid-body: those still held are one log line each, not a traceback.
        for writer in stalled:
            writer.transport.abort()

        def all_closed() -> dict[str, float]:
            closed = running.closed("api")
            return closed if closed["evicted"] + closed["client_gone"] == 12 else {}

        closed = await wait_for(all_closed, timeout=5, interval=0.01, what="12 stalled bodies closed")
    assert closed["evicted"] >= 8  # each newcomer past the cap evicted the longest stalled body
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert not [line for line in lines if "exception" in line]
    gone = [line for line in lines if line["event"] == "client left mid-request"]
    assert len(gone) == closed["client_gone"] >= 1
    assert {(line["server"], line["method"], line["path"]) for line in gone} == {("api", "POST", "/webhook")}


@pytest.mark.parametrize(
    ("head", "trickled"),
    [
        pytest.param(b"", b"POST /webhook HTTP/1.1\r\nHost: x\r\n", id="headers"),
        pytest.param(
            b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", b"{" * 1000, id="body"
        ),
    ],
)
async def test_a_client_trickling_over_tls_is_cut(running: Running, head: bytes, trickled: bytes) -> None:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            "127.0.0.1", running.server.port, ssl=running.client_context(), server_hostname="127.0.0.1"
        ),
        5,
    )
    writer.write(head)
    started = time.monotonic()
    sender = asyncio.create_task(trickle(writer, trickled))
    assert await closed_by_server(reader) == b""
    elapsed = time.monotonic() - started
    sender.cancel()
    await close(writer)
    assert 0.4 <= elapsed < 3, elapsed
    assert not sender.done() or sender.cancelled()  # it was still sending when cut
    assert await running.probe() == 200


# -- malformed bodies: HTTP 400 ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason", "says"),
    [
        pytest.param(b"[" * 100_000, "invalid", "Expected `object`, got `array`", id="deep-array"),
        pytest.param(
            b'{"a":' * 5_000 + b"1" + b"}" * 5_000, "too_deep", "nested too deeply", id="deep-object"
        ),
        pytest.param(b"\xff\xfe{}", "not_json", "not JSON", id="not-utf8"),
        pytest.param(
            json.dumps(review(GPU_POD, namespace=["ns"])).encode(),
            "invalid",
            "Expected `str | null`, got `array` - at `$.request.namespace`",
            id="namespace-array",
        ),
        pytest.param(
            json.dumps(review(GPU_POD, operation={"op": "CREATE"})).encode(),
            "invalid",
            "Expected `str | null`, got `object` - at `$.request.operation`",
            id="operation-object",
        ),
        pytest.param(
            json.dumps({**review(GPU_POD), "kind": ["x"] * 10_000}).encode(),
            "invalid",
            "Expected `str`, got `array` - at `$.kind`",
            id="kind-list-not-echoed",
        ),
    ],
)
async def test_a_malformed_body_gets_400_with_its_reason(
    running: Running, body: bytes, reason: str, says: str
) -> None:
    status, raw = await running.request("POST", "/webhook", body)
    assert status == 400
    answer = json.loads(raw)
    assert answer["error"] == reason
    assert says in answer["message"]
    assert len(raw) < 1000  # the client's value is named, not echoed back


# -- malformed pods: HTTP 400 naming the field ----------------------------------------------------------


def with_field(path: tuple[str | int, ...], value: object) -> dict[str, Any]:
    pod = copy.deepcopy(GPU_POD)
    node: Any = pod
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
    node[path[-1]] = value
    return pod


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        pytest.param(
            with_field(("metadata", "annotations"), ["a"]),
            "Expected `object | null`, got `array` - at `$.request.object.metadata.annotations`",
            id="annotations-array",
        ),
        pytest.param(
            with_field(("metadata", "annotations"), "a=b"),
            "Expected `object | null`, got `str` - at `$.request.object.metadata.annotations`",
            id="annotations-string",
        ),
        pytest.param(
            with_field(("metadata", "annotations", "team"), 7),
            "Expected `str`, got `int` - at `$.request.object.metadata.annotations[...]`",
            id="annotation-value-number",
        ),
        pytest.param(
            with_field(("metadata",), "p"), "got `str` - at `$.request.object.metadata`", id="metadata-string"
        ),
        pytest.param(
            with_field(("metadata", "name"), ["p"]),
            "got `array` - at `$.request.object.metadata.name`",
            id="name-array",
        ),
        pytest.param(
            with_field(("spec", "containers"), "c"),
            "got `str` - at `$.request.object.spec.containers`",
            id="containers-string",
        ),
        pytest.param(
            with_field(("spec", "containers", 0, "env"), [{"name": ["X"]}]),
            "got `array` - at `$.request.object.spec.containers[0].env[0].name`",
            id="env-name-array",
        ),
        pytest.param(
            with_field(("spec", "containers", 0, "env"), [{"name": "NVIDIA_VISIBLE_DEVICES", "value": 1}]),
            "got `int` - at `$.request.object.spec.containers[0].env[0].value`",
            id="env-value-number",
        ),
        pytest.param(
            with_field(("spec", "containers", 0, "envFrom"), [{"prefix": {"p": "CUDA_"}}]),
            "got `object` - at `$.request.object.spec.containers[0].envFrom[0].prefix`",
            id="env-from-prefix-object",
        ),
        pytest.param(
            with_field(("spec", "ephemeralContainers"), [{"env": "x"}]),
            "got `str` - at `$.request.object.spec.ephemeralContainers[0].env`",
            id="ephemeral-env-string",
        ),
        pytest.param(with_field(("spec",), [1]), "got `array` - at `$.request.object.spec`", id="spec-array"),
        pytest.param(["not", "a", "pod"], "got `array` - at `$.request.object`", id="object-array"),
    ],
)
async def test_a_malformed_pod_gets_400_naming_the_field(running: Running, pod: object, says: str) -> None:
    status, raw = await running.request("POST", "/webhook", json.dumps(review(pod)).encode())
    assert status == 400
    answer = json.loads(raw)
    assert answer["error"] == "invalid"
    assert says in answer["message"]
    metrics = running.server.admitter.telemetry.metrics.registry
    assert metrics.get_sample_value("hamipy_webhook_bad_requests_total", {"reason": "invalid"}) == 1


async def test_a_well_formed_pod_with_nulls_is_still_admitted(running: Running) -> None:
    # JSON null is "absent", as the API server writes it for empty fields (creationTimestamp).
    pod = with_field(("metadata", "annotations"), None)
    pod["metadata"]["creationTimestamp"] = None
    pod["spec"]["initContainers"] = None
    status, answer = await running.admit(review(pod))
    assert (status, answer["response"]["allowed"], answer["response"]["patchType"]) == (
        200,
        True,
        "JSONPatch",
    )


# -- settings ---------------------------------------------------------------------------------------------


def test_the_limits_come_from_flags_and_the_environment() -> None:
    env = {
        "HAMIPY_WEBHOOK_HEADER_TIMEOUT": "3",
        "HAMIPY_WEBHOOK_MAX_CONNECTIONS": "50",
        "HAMIPY_WEBHOOK_MAX_QUEUED_CONNECTIONS": "7",
    }
    args = cli.build_parser(env).parse_args(["serve", "--body-timeout", "4", "--keepalive-timeout", "30"])
    limits = settings_from(ServerSettings, args).limits
    assert (limits.header_timeout_s, limits.body_timeout_s) == (3, 4)
    assert (limits.keepalive_timeout_s, limits.max_connections, limits.max_queued) == (30, 50, 7)
    defaults = settings_from(ServerSettings, cli.build_parser({}).parse_args(["serve"])).limits
    assert (defaults.header_timeout_s, defaults.body_timeout_s, defaults.keepalive_timeout_s) == (10, 10, 75)
    assert (defaults.max_connections, defaults.max_queued) == (256, 512)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--header-timeout", "0"], id="zero-timeout"),
        pytest.param(["--max-connections", "0"], id="zero-connections"),
    ],
)
def test_a_limit_out_of_range_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *argv], env={})
    assert exit_info.value.code == 2
    assert "must be" in capsys.readouterr().err
