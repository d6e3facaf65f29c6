"""The webhook served to the real kube-apiserver.

The webhook runs in the test process (or as the ``hamipy-webhook`` console script) on
``https://127.0.0.1:<port>/webhook`` with a certificate for 127.0.0.1, and is registered with the
MutatingWebhookConfiguration our builder makes, its caBundle filled in and, so that it touches
nothing else in the shared control plane, a namespaceSelector for the test's namespace only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import builders
import pytest
from stack_support import Webhook, start_webhook, stop_webhook
from stack_support import register_webhook as register
from stack_support import unregister_webhook as unregister

from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.protocol import keys
from hamipy.webhook.certificate_setup import ensure_certificates
from hamipy.webhook.certs import generate_certificates, write_files
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.registration import webhook_configuration

pytestmark = pytest.mark.integration

API_TIMEOUT_S = 10.0
GPU_LIMITS = {"nvidia.com/gpumem": "3000", "nvidia.com/priority": "0"}


def pod_body(name: str, *, limits: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    """``builders.pod`` of one container limited to ``limits``; ``fields`` as ``builders.pod`` takes them."""
    return builders.pod(name, builders.container(limits=limits), **fields)


@pytest.fixture
async def webhook(kube_client: Any, namespace: str, tmp_path: Path) -> AsyncIterator[Webhook]:
    hook = await start_webhook(kube_client, namespace, tmp_path)
    try:
        yield hook
    finally:
        await stop_webhook(hook)


async def create(api: Any, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    from kubernetes_asyncio import client

    core: Any = client.CoreV1Api(api)
    pod = await core.create_namespaced_pod(namespace, body, _request_timeout=API_TIMEOUT_S)
    return cast(dict[str, Any], api.sanitize_for_serialization(pod))


async def refused(api: Any, namespace: str, body: dict[str, Any]) -> tuple[int, str]:
    from kubernetes_asyncio import client

    with pytest.raises(client.ApiException) as info:
        await create(api, namespace, body)
    answer = info.value.body
    assert answer is not None
    message = json.loads(answer)["message"]
    return int(info.value.status), str(message)


# -- the Done-when list ----------------------------------------------------------------------------------


async def test_gpu_pod_gets_hami_scheduler_and_defaults(
    webhook: Webhook, kube_client: Any, namespace: str
) -> None:
    pod = await create(kube_client, namespace, pod_body("gpu", limits=GPU_LIMITS))
    spec = pod["spec"]
    assert spec["schedulerName"] == "hami-scheduler"
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"  # the apiserver's defaulting
    assert "env" not in container  # the priority travels with the device plugin's limits
    traceparent = pod["metadata"]["annotations"][keys.TRACE_CONTEXT]
    assert traceparent.startswith("00-")
    assert len(traceparent.split("-")[1]) == 32
    assert webhook.metric("hamipy_webhook_admissions_total", outcome="mutated", reason="patched") >= 1
    lines = [json.loads(line) for line in webhook.log.getvalue().splitlines()]
    assert any(line.get("namespace") == namespace and line.get("name") == "gpu" for line in lines)


async def test_whole_gpu_ask_gets_exclusive_cores(webhook: Webhook, kube_client: Any, namespace: str) -> None:
    pod = await create(kube_client, namespace, pod_body("whole", limits={"nvidia.com/gpu": "2"}))
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpucores"] == "100"


async def test_non_gpu_pod_is_untouched(webhook: Webhook, kube_client: Any, namespace: str) -> None:
    before = webhook.metric("hamipy_webhook_admission_duration_seconds_count", outcome="allowed")
    pod = await create(kube_client, namespace, pod_body("web", limits={"cpu": "100m"}))
    assert pod["spec"]["schedulerName"] == "default-scheduler"
    assert keys.TRACE_CONTEXT not in (pod["metadata"].get("annotations") or {})
    assert "env" not in pod["spec"]["containers"][0]
    # matchConditions kept it from reaching the webhook at all
    assert webhook.metric("hamipy_webhook_admission_duration_seconds_count", outcome="allowed") == before


async def test_privileged_gpu_pod_is_refused(webhook: Webhook, kube_client: Any, namespace: str) -> None:
    body = builders.pod("priv", builders.container(limits=GPU_LIMITS, securityContext={"privileged": True}))
    status, message = await refused(kube_client, namespace, body)
    assert status == 403  # our status.code, passed through by the apiserver
    assert "denied the request" in message
    assert "'main'" in message
    assert "privileged" in message


async def test_gpu_pod_with_node_name_is_refused(webhook: Webhook, kube_client: Any, namespace: str) -> None:
    status, message = await refused(
        kube_client, namespace, pod_body("pinned", limits=GPU_LIMITS, node_name="gpu-7")
    )
    assert status == 403  # our status.code, passed through by the apiserver
    assert "spec.nodeName" in message
    assert "gpu-7" in message


async def test_bad_memory_percentage_is_refused(webhook: Webhook, kube_client: Any, namespace: str) -> None:
    body = pod_body("pct", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "150"})
    status, message = await refused(kube_client, namespace, body)
    assert status == 403  # our status.code, passed through by the apiserver
    assert "nvidia.com/gpumem-percentage" in message
    assert "150" in message


async def test_gpu_pod_of_another_scheduler_is_refused(
    webhook: Webhook, kube_client: Any, namespace: str
) -> None:
    status, message = await refused(
        kube_client, namespace, pod_body("other", limits=GPU_LIMITS, scheduler_name="volcano")
    )
    assert status == 403
    assert "'volcano'" in message
    assert "allowedSchedulers" in message


async def test_gpu_pod_of_an_allowed_scheduler_is_left_alone(
    kube_client: Any, namespace: str, tmp_path: Path
) -> None:
    settings = MutationSettings(allowed_schedulers=frozenset({"volcano"}))
    hook = await start_webhook(kube_client, namespace, tmp_path, settings=settings)
    try:
        pod = await create(
            kube_client, namespace, pod_body("other", limits=GPU_LIMITS, scheduler_name="volcano")
        )
    finally:
        await stop_webhook(hook)
    assert pod["spec"]["schedulerName"] == "volcano"
    assert "nvidia.com/gpu" not in pod["spec"]["containers"][0]["resources"]["limits"]
    assert hook.metric("hamipy_webhook_admissions_total", outcome="allowed", reason="other_scheduler") == 1


async def test_stopped_webhook_refuses_gpu_pods_and_admits_others(
    webhook: Webhook, kube_client: Any, namespace: str
) -> None:
    await webhook.stop()
    status, message = await refused(kube_client, namespace, pod_body("gpu-down", limits=GPU_LIMITS))
    assert status >= 500
    assert "failed calling webhook" in message
    pod = await create(kube_client, namespace, pod_body("web-down", limits={"cpu": "100m"}))
    assert pod["spec"]["schedulerName"] == "default-scheduler"
    # and it serves again once restarted on the same port
    await webhook.start()
    pod = await create(kube_client, namespace, pod_body("gpu-up", limits=GPU_LIMITS))
    assert pod["spec"]["schedulerName"] == "hami-scheduler"


async def test_v1beta1_reviews_are_answered(kube_client: Any, namespace: str, tmp_path: Path) -> None:
    hook = Webhook(
        kube_client,
        namespace,
        generate_certificates(dns_names=["localhost"], ip_addresses=["127.0.0.1"]),
        tmp_path,
    )
    await hook.start()
    try:
        await register(
            kube_client,
            name=hook.configuration,
            namespace=namespace,
            url=f"https://127.0.0.1:{hook.port}/webhook",
            ca_pem=hook.certs.ca_pem,
            versions=["v1beta1"],
        )
        pod = await create(kube_client, namespace, pod_body("beta", limits=GPU_LIMITS))
        assert pod["spec"]["schedulerName"] == "hami-scheduler"
    finally:
        await unregister(kube_client, hook.configuration)
        await hook.stop()


# -- the console script ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_console_script_serves_the_apiserver_and_stops_on_sigterm(
    kube_client: Any, namespace: str, tmp_path: Path
) -> None:
    certs = generate_certificates(dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    cert, key, _ = write_files(certs, tmp_path)
    config = tmp_path / "hami-py.yaml"
    config.write_text("schedulerName: gpu-scheduler\n")
    port, metrics_port = free_port(), free_port()
    script = Path(sys.executable).parent / "hamipy-webhook"
    log = (tmp_path / "webhook.log").open("wb")
    env = {**os.environ, "HAMIPY_CONFIG": str(config), "HAMIPY_WEBHOOK_CERT_FILE": str(cert)}
    argv = [str(script), "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; everything after waits without blocking
        [*argv, "--key-file", str(key)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    name = f"hamipy-webhook-cli-{namespace}"
    try:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def ready() -> bool:
                assert proc.poll() is None, (tmp_path / "webhook.log").read_text()
                async with session.get(f"http://127.0.0.1:{metrics_port}/readyz") as response:
                    return response.status == 200

            await wait_for(ready, timeout=30, what="hamipy-webhook to be ready")
        from kubernetes_asyncio import client

        doc = webhook_configuration(
            name=name, url=f"https://127.0.0.1:{port}/webhook", ca_bundle=certs.ca_pem
        )
        doc["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        admission: Any = client.AdmissionregistrationV1Api(kube_client)
        await admission.create_mutating_webhook_configuration(doc, _request_timeout=API_TIMEOUT_S)
        core: Any = client.CoreV1Api(kube_client)

        async def mutated() -> bool:
            pod = await core.create_namespaced_pod(
                namespace, pod_body("cli", limits=GPU_LIMITS), dry_run="All", _request_timeout=API_TIMEOUT_S
            )
            return bool(pod.spec.scheduler_name == "gpu-scheduler")

        await wait_for(mutated, timeout=30, interval=0.2, what="the console script to mutate a pod")
    finally:
        await unregister(kube_client, name)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 20)
        log.close()
    assert code == 0
    lines = [
        json.loads(line)
        for line in (tmp_path / "webhook.log").read_text().splitlines()
        if line.startswith("{")
    ]
    events = [line["event"] for line in lines]
    assert "webhook serving" in events
    assert "stopping on signal" in events
    assert any(line.get("event") == "pod admitted" and line.get("namespace") == namespace for line in lines)


# -- certificates for a real cluster -----------------------------------------------------------------


async def test_certs_writes_secret_and_patches_ca_bundle(kube_client: Any, namespace: str) -> None:
    from kubernetes_asyncio import client

    name = f"hamipy-webhook-certs-{namespace}"
    create = webhook_configuration(name=name, service_name="hamipy-webhook", service_namespace=namespace)
    # Never matches a pod: this configuration points at a Service that does not exist here.
    create["webhooks"][0]["objectSelector"] = {"matchLabels": {"hami-py.io/never": "true"}}
    create["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    admission: Any = client.AdmissionregistrationV1Api(kube_client)
    core: Any = client.CoreV1Api(kube_client)
    kwargs: dict[str, Any] = {
        "namespace": namespace,
        "secret_name": "hamipy-webhook-tls",
        "service_name": "hamipy-webhook",
        "configuration_name": name,
        "create_configuration": create,
    }
    kube = RawKube(kube_client)
    try:
        bundle, renewed, patched = await ensure_certificates(kube, **kwargs)
        assert (renewed, patched) == (True, True)
        secret = await core.read_namespaced_secret(
            "hamipy-webhook-tls", namespace, _request_timeout=API_TIMEOUT_S
        )
        assert secret.type == "kubernetes.io/tls"
        assert set(secret.data) == {"tls.crt", "tls.key", "ca.crt"}
        stored = await admission.read_mutating_webhook_configuration(name, _request_timeout=API_TIMEOUT_S)
        assert base64.b64decode(stored.webhooks[0].client_config.ca_bundle) == bundle.ca_pem

        again, renewed, patched = await ensure_certificates(kube, **kwargs)
        assert (again, renewed, patched) == (bundle, False, False)

        fresh, renewed, patched = await ensure_certificates(kube, **kwargs, force=True)
        assert (renewed, patched) == (True, True)
        assert fresh.ca_pem != bundle.ca_pem
        stored = await admission.read_mutating_webhook_configuration(name, _request_timeout=API_TIMEOUT_S)
        assert base64.b64decode(stored.webhooks[0].client_config.ca_bundle) == fresh.ca_pem
    finally:
        await unregister(kube_client, name)


# -- as a tenant: a ServiceAccount with pod rights only in its namespace (docs/security.md) ------------


@pytest.fixture
async def tenant(devcluster: Any, kube_client: Any, namespace: str) -> AsyncIterator[Any]:
    from hamipy.devcluster.identities import TENANT_POD_RULES, grant_role, issue_identity

    access = devcluster.access
    identity = await issue_identity(
        kube_client, namespace=namespace, name="tenant", server=access.server, ca_file=access.ca_file
    )
    await grant_role(kube_client, namespace=namespace, account="tenant", rules=TENANT_POD_RULES)
    async with identity.api_client() as api:
        yield api


async def test_a_pod_cannot_opt_itself_out_of_the_webhook(
    webhook: Webhook, tenant: Any, namespace: str
) -> None:
    ignored = pod_body("opted-out", limits=GPU_LIMITS, labels={"hami.io/webhook": "ignore"})
    pod = await create(tenant, namespace, ignored)
    assert pod["spec"]["schedulerName"] == "hami-scheduler"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Pinned to a node of the tenant's choice, with or without the label: refused.
    pinned = pod_body(
        "opted-out-pinned", limits=GPU_LIMITS, labels={"hami.io/webhook": "ignore"}, node_name="n"
    )
    status, message = await refused(tenant, namespace, pinned)
    assert status == 403
    assert "spec.nodeName" in message
    # And with the webhook down the label gets it nowhere: refused, not admitted unmutated.
    await webhook.stop()
    status, message = await refused(
        tenant, namespace, pod_body("opted-out-down", limits=GPU_LIMITS, labels={"hami.io/webhook": "ignore"})
    )
    assert status >= 500
    assert "failed calling webhook" in message
