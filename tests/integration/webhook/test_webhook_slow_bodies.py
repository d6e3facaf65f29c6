"""The real kube-apiserver's admission calls get through while a pod floods the webhook's TLS port
with requests whose bodies never finish, past its connection cap; the flood's clients leaving
mid-body are log lines, not tracebacks."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from pathlib import Path
from typing import Any

import builders
import connection_metrics
import pytest
from stack_support import start_webhook, stop_webhook

from hamipy.devcluster.waiting import wait_for
from hamipy.serving.http_limits import HttpLimits

pytestmark = pytest.mark.integration

API_TIMEOUT_S = 10.0
CAP = 8
STALLED = 3 * CAP
STALLED_HEAD = b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n{"


async def test_gpu_pods_are_admitted_while_stalled_bodies_flood_the_webhook(
    kube_client: Any, namespace: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kubernetes_asyncio import client

    # Timeouts past the test's length: only the cap decides who is served.
    limits = HttpLimits(header_timeout_s=120, body_timeout_s=120, max_connections=CAP)
    webhook = await start_webhook(kube_client, namespace, tmp_path, limits=limits)
    metrics = webhook.admitter.telemetry.metrics.registry

    def closed() -> dict[str, float]:
        return connection_metrics.closed(metrics, "hamipy_webhook", "api")

    try:
        context = ssl.create_default_context(cadata=webhook.certs.ca_pem.decode())

        async def stall() -> asyncio.StreamWriter | None:
            try:
                _, writer = await asyncio.open_connection(
                    "127.0.0.1", webhook.port, ssl=context, server_hostname="127.0.0.1"
                )
            except (OSError, ssl.SSLError):  # evicted in its handshake by a later one
                return None
            writer.write(STALLED_HEAD)
            await writer.drain()
            return writer

        def taken_in() -> float:  # held (perhaps evicted since) or queued
            labels = {"server": "api"}
            accepted = metrics.get_sample_value("hamipy_webhook_http_connections_accepted_total", labels)
            queued = metrics.get_sample_value("hamipy_webhook_http_connections_queued", labels)
            return (accepted or 0) + (queued or 0)

        before = taken_in()  # the API server's own connections
        stalling = [asyncio.create_task(stall()) for _ in range(STALLED)]
        try:
            await wait_for(
                lambda: taken_in() - before >= STALLED, timeout=30, interval=0.05, what="the stalled bodies"
            )
            core: Any = client.CoreV1Api(kube_client)
            for i in range(5):
                body = builders.pod(f"gpu-{i}", builders.container(gpu=1))
                pod = await core.create_namespaced_pod(namespace, body, _request_timeout=API_TIMEOUT_S)
                assert pod.spec.scheduler_name == "hami-scheduler"  # mutated by the webhook
        finally:
            for task in stalling:
                task.cancel()
            for writer in await asyncio.gather(*stalling, return_exceptions=True):
                if isinstance(writer, asyncio.StreamWriter):
                    writer.transport.abort()  # gone mid-body, as a killed pod's connections
        # Those still held left mid-body; the webhook's stop would close any it has not yet seen go.
        await wait_for(
            lambda: closed()["client_gone"] >= 1, timeout=10, interval=0.05, what="the clients' leaving"
        )
    finally:
        await stop_webhook(webhook)
    cuts = closed()
    assert cuts["evicted"] >= STALLED - CAP
    assert cuts["body_timeout"] == cuts["queue_timeout"] == cuts["refused"] == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    lines = [json.loads(line) for line in webhook.log.getvalue().splitlines()]
    assert not [line for line in lines if "exception" in line]
    gone = [line for line in lines if line["event"] == "client left mid-request"]
    assert len(gone) == cuts["client_gone"] >= 1
