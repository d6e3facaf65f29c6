"""Our services started in the test process against the devcluster, for the integration tests:
the webhook registered with the apiserver for one namespace, and extender replicas wired into the
``hami-scheduler`` kube-scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hamipy.devcluster import ExtenderConfig, ManagedResource, wait_for
from hamipy.extender.kube import ApiClientKube
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry as ExtenderTelemetry
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.webhook.admitting import Admitter
from hamipy.webhook.certs import CertificateBundle, generate_certificates, write_files
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.registration import webhook_configuration
from hamipy.webhook.server import ServerSettings, WebhookServer
from hamipy.webhook.telemetry import Telemetry

API_TIMEOUT_S = 10.0
EXTENDER_SETTINGS = ExtenderSettings(handshake_interval_s=0, bind_timeout_s=20.0, api_timeout_s=10.0)
MANAGED = tuple(
    ManagedResource(name)
    for name in (
        keys.RESOURCE_COUNT,
        keys.RESOURCE_MEMORY,
        keys.RESOURCE_MEMORY_PERCENTAGE,
        keys.RESOURCE_CORES,
    )
)


class Webhook:
    """A webhook in this process, registered for one namespace."""

    def __init__(self, api: Any, namespace: str, certs: CertificateBundle, tmp: Path) -> None:
        self.api = api
        self.namespace = namespace
        self.certs = certs
        self.cert_file, self.key_file, _ = write_files(certs, tmp)
        self.log = io.StringIO()
        self.admitter = Admitter(MutationSettings(), Telemetry.create({}, stream=self.log))
        self.server: WebhookServer | None = None
        self.port = 0
        self.configuration = f"hamipy-webhook-{namespace}"

    async def start(self) -> None:
        settings = ServerSettings(
            cert_file=self.cert_file,
            key_file=self.key_file,
            host="127.0.0.1",
            port=self.port,
            shutdown_timeout_s=1.0,
        )
        self.server = WebhookServer(settings, self.admitter)
        await self.server.start()
        self.port = self.server.port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None

    def metric(self, name: str, **labels: str) -> float:
        value = self.admitter.telemetry.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


async def start_webhook(api: Any, namespace: str, tmp: Path) -> Webhook:
    """A webhook in this process with a certificate for 127.0.0.1, registered for `namespace` only."""
    hook = Webhook(
        api, namespace, generate_certificates(dns_names=["localhost"], ip_addresses=["127.0.0.1"]), tmp
    )
    await hook.start()
    try:
        await register_webhook(
            api,
            name=hook.configuration,
            namespace=namespace,
            url=f"https://127.0.0.1:{hook.port}/webhook",
            ca_pem=hook.certs.ca_pem,
        )
    except BaseException:
        await hook.stop()
        raise
    return hook


async def stop_webhook(hook: Webhook) -> None:
    await unregister_webhook(hook.api, hook.configuration)
    await hook.stop()


def probe_pod(name: str, limits: dict[str, str]) -> dict[str, Any]:
    container = {"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": {"limits": limits}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container]},
    }


async def register_webhook(
    api: Any, *, name: str, namespace: str, url: str, ca_pem: bytes, versions: list[str] | None = None
) -> None:
    """Create the webhook configuration for `namespace` only and wait until the apiserver applies it."""
    from kubernetes_asyncio import client

    doc = webhook_configuration(name=name, url=url, ca_bundle=ca_pem, timeout_seconds=5)
    hook = doc["webhooks"][0]
    hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    if versions is not None:
        hook["admissionReviewVersions"] = versions
    admission: Any = client.AdmissionregistrationV1Api(api)
    await admission.create_mutating_webhook_configuration(doc, _request_timeout=API_TIMEOUT_S)
    core: Any = client.CoreV1Api(api)

    async def applied() -> bool:
        probe = probe_pod("probe", {keys.RESOURCE_COUNT: "1"})
        pod = await core.create_namespaced_pod(
            namespace, probe, dry_run="All", _request_timeout=API_TIMEOUT_S
        )
        return bool(pod.spec.scheduler_name == "hami-scheduler")

    await wait_for(applied, timeout=30, interval=0.2, what=f"webhook configuration {name} to take effect")


async def unregister_webhook(api: Any, name: str) -> None:
    from kubernetes_asyncio import client

    admission: Any = client.AdmissionregistrationV1Api(api)
    with contextlib.suppress(client.ApiException):
        await admission.delete_mutating_webhook_configuration(name, _request_timeout=API_TIMEOUT_S)


async def start_extenders(
    api: Any, n: int = 1, settings: ExtenderSettings = EXTENDER_SETTINGS, config: Config | None = None
) -> list[ExtenderServer]:
    """`n` extender replicas in this process, each synced with the cluster."""
    servers = []
    for _ in range(n):
        server = ExtenderServer(
            config=config or Config(),
            settings=settings,
            telemetry=ExtenderTelemetry.create({}, stream=io.StringIO()),
            api=ApiClientKube(api),
        )
        await server.start()
        servers.append(server)
    for server in servers:
        await server.wait_synced(30)
    return servers


async def use_extender(hami_scheduler: Callable[..., Any], url: str, *, cooperative: bool = False) -> None:
    """(Re)start the hami-scheduler with the extender at `url`."""
    config = ExtenderConfig(
        url_prefix=url,
        filter_verb="filter",
        bind_verb="bind",
        prioritize_verb="prioritize" if cooperative else "",
        node_cache_capable=True,
        managed_resources=MANAGED,
        http_timeout_s=30,
    )
    await asyncio.to_thread(hami_scheduler, config)
