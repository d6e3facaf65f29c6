"""Our services started in the test process against the devcluster, for the integration tests:
the webhook registered with the apiserver for one namespace, and extender replicas wired into the
``hami-scheduler`` kube-scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import builders
import pytest
from kubernetes_asyncio.client import CoreV1Api
from prometheus_client.parser import text_string_to_metric_families

from hamipy.devcluster import DevCluster, ExtenderConfig, ManagedResource, wait_for
from hamipy.devcluster.containerd_runtime import NVIDIA_HANDLER
from hamipy.devcluster.gpu_nodes import DevicePluginAgent, FakeGpu, MonitorAgent, Topology
from hamipy.devcluster.kubelet_nodes import KubeletNode, gpu_kubelet_node
from hamipy.devcluster.kubeobjects import ensure_runtime_class
from hamipy.devcluster.real_kubelet import ContainerConfig, can_run_real_kubelets
from hamipy.extender.invariant import check_cluster
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry as ExtenderTelemetry
from hamipy.kube.client import RawKube
from hamipy.protocol import ContainerDevice, decode_pod_devices, keys
from hamipy.protocol.config import Config
from hamipy.serving.http_limits import HttpLimits
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
        keys.RESOURCE_PRIORITY,
    )
)


class Webhook:
    """A webhook in this process, registered for one namespace; with ``metrics`` also serving
    ``/metrics`` on a plain-HTTP port (``metrics_port``), as the chart runs it; deciding with
    ``settings`` (the defaults when None); under ``limits`` (the defaults when None)."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        certs: CertificateBundle,
        tmp: Path,
        *,
        metrics: bool = False,
        settings: MutationSettings | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.certs = certs
        self.cert_file, self.key_file, self.ca_file = write_files(certs, tmp)
        self.log = io.StringIO()
        self.admitter = Admitter(settings or MutationSettings(), Telemetry.create(stream=self.log))
        self.server: WebhookServer | None = None
        self.port = 0
        self.metrics = metrics
        self.limits = limits or HttpLimits()
        self.metrics_port: int | None = None
        self.configuration = f"hamipy-webhook-{namespace}"

    async def start(self) -> None:
        settings = ServerSettings(
            cert_file=self.cert_file,
            key_file=self.key_file,
            host="127.0.0.1",
            port=self.port,
            metrics_port=0 if self.metrics else None,
            shutdown_timeout_s=1.0,
            limits=self.limits,
        )
        self.server = WebhookServer(settings, self.admitter)
        await self.server.start()
        self.port = self.server.port
        self.metrics_port = self.server.metrics_port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None

    def metric(self, name: str, **labels: str) -> float:
        value = self.admitter.telemetry.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


async def start_webhook(
    api: Any,
    namespace: str,
    tmp: Path,
    *,
    metrics: bool = False,
    settings: MutationSettings | None = None,
    limits: HttpLimits | None = None,
) -> Webhook:
    """A webhook in this process with a certificate for 127.0.0.1, registered for `namespace` only
    (``metrics``, ``settings``, ``limits``: see ``Webhook``). Its tracing follows this process's
    OTEL_* variables (a test sets them with monkeypatch)."""
    certs = generate_certificates(dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    hook = Webhook(api, namespace, certs, tmp, metrics=metrics, settings=settings, limits=limits)
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
        probe = builders.pod("probe", builders.container(gpu=1))
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


def elected(namespace: str) -> ExtenderSettings:
    """``EXTENDER_SETTINGS`` for replicas electing their leader by a Lease in ``namespace``, with
    short times (failover in about 8 s) that still fence: lease > renew deadline + API timeout."""
    return dataclasses.replace(
        EXTENDER_SETTINGS,
        leader_election=True,
        lease_namespace=namespace,
        api_timeout_s=3.0,
        lease_duration_s=8.0,
        renew_deadline_s=4.0,
        retry_period_s=0.5,
        leader_wait_s=10.0,
    )


async def start_extenders(
    api: Any,
    n: int = 1,
    settings: ExtenderSettings = EXTENDER_SETTINGS,
    config: Config | None = None,
    own_pods: Sequence[str] = (),
) -> list[ExtenderServer]:
    """`n` extender replicas in this process, each synced with the cluster (a cold standby watches
    nothing until it leads: only the leader then); replica ``i`` labels the pod ``own_pods[i]``
    (``namespace/name``) with its role when given. Their tracing follows this process's OTEL_*
    variables."""
    servers = []
    for i in range(n):
        own_pod = own_pods[i] if i < len(own_pods) else ""
        server = ExtenderServer(
            config=config or Config(),
            settings=dataclasses.replace(settings, identity=f"replica-{i}", own_pod=own_pod)
            if settings.leader_election
            else settings,
            telemetry=ExtenderTelemetry.create(stream=io.StringIO()),
            api=RawKube(api),
        )
        await server.start()
        servers.append(server)
    for server in servers:
        if server.health.watching:
            await server.wait_synced(30)
    if not all(server.health.watching for server in servers):
        await wait_for(
            lambda: any(server.leadership.exclusive() for server in servers),
            timeout=30,
            what="a cold standby to lead, synced",
        )
    return servers


def extender_config(url: str, *, cooperative: bool = False) -> ExtenderConfig:
    """The hami-scheduler's extender entry the integration tests run (the chart renders the same)."""
    return ExtenderConfig(
        url_prefix=url,
        filter_verb="filter",
        bind_verb="bind",
        preempt_verb="preempt",
        prioritize_verb="prioritize" if cooperative else "",
        node_cache_capable=True,
        managed_resources=MANAGED,
        http_timeout_s=30,
    )


async def use_extender(hami_scheduler: Callable[..., Any], url: str, *, cooperative: bool = False) -> None:
    """(Re)start the hami-scheduler with the extender at `url`."""
    await asyncio.to_thread(hami_scheduler, extender_config(url, cooperative=cooperative))


# -- a GPU node with the whole path in front of it ------------------------------------------------

RESOURCE = keys.RESOURCE_COUNT
NATIVE_BUILD = Path(__file__).resolve().parents[2] / "native" / "build"
NEEDS_REAL_KUBELET = pytest.mark.skipif(
    can_run_real_kubelets() is not None, reason=f"skipped: {can_run_real_kubelets()}"
)
"""For tests of a GPU node: its kubelet is the real one, which needs root (a mount namespace)."""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def sample_key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


async def scrape_text(url: str) -> str:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(url) as resp,
    ):
        assert resp.status == 200, f"GET {url}: HTTP {resp.status}"
        return await resp.text()


def samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class GpuStack:
    """One GPU node (the real kubelet over the fake runtime, the device plugin process), and helpers
    to create pods and read what the kubelet made of them."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        kubelet_node: KubeletNode,
        plugin: DevicePluginAgent,
        extender: ExtenderServer,
    ):
        self.api = api
        self.extender = extender
        self.core = CoreV1Api(api)
        self.namespace = namespace
        self.kubelet_node = kubelet_node
        self.node = kubelet_node.name
        self.plugin = plugin

    def pod_body(
        self,
        name: str,
        containers: list[dict[str, Any]],
        init: list[dict[str, Any]] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """``builders.pod`` for this stack's node, deleted at once."""
        return builders.pod(
            name,
            *containers,
            init=init or (),
            annotations=annotations,
            nodeSelector={"gpu-test": self.namespace},
            terminationGracePeriodSeconds=0,
        )

    async def create(self, body: dict[str, Any]) -> None:
        core: Any = self.core  # its hint asks for a V1Pod; the client sends a JSON body as it is
        await core.create_namespaced_pod(self.namespace, body, _request_timeout=API_TIMEOUT_S)

    async def pod(self, name: str) -> dict[str, Any]:
        pod = await self.core.read_namespaced_pod(name, self.namespace, _request_timeout=API_TIMEOUT_S)
        out: dict[str, Any] = self.api.sanitize_for_serialization(pod)
        return out

    async def served(self, name: str, timeout: float = 60) -> dict[str, Any]:  # noqa: ASYNC109
        """The pod once its device plugin has marked it ``bind-phase=success``."""

        async def done() -> dict[str, Any] | None:
            pod = await self.pod(name)
            phase = (pod["metadata"].get("annotations") or {}).get(keys.BIND_PHASE)
            assert phase != "failed", f"pod {name} failed allocation: {pod['metadata'].get('annotations')}"
            return pod if phase == "success" else None

        pod: dict[str, Any] | None = await wait_for(
            done, timeout=timeout, interval=0.1, what=f"pod {name} served"
        )
        assert pod is not None  # wait_for returns the first truthy value
        return pod

    async def running(self, name: str, timeout: float = 60) -> dict[str, Any]:  # noqa: ASYNC109
        """The pod once the kubelet reports it Running."""

        async def up() -> dict[str, Any] | None:
            pod = await self.pod(name)
            return pod if pod["status"].get("phase") == "Running" else None

        pod: dict[str, Any] | None = await wait_for(
            up, timeout=timeout, interval=0.1, what=f"pod {name} Running"
        )
        assert pod is not None
        return pod

    async def container(self, pod: str, container: str, timeout: float = 60) -> ContainerConfig:  # noqa: ASYNC109
        """The config the kubelet created `pod`'s `container` with (the fake runtime's record)."""
        return await self.kubelet_node.wait_container(self.namespace, pod, container, timeout_s=timeout)

    def device_ids(self, pod_uid: str, container: str) -> list[str]:
        """The kubelet's device IDs for a container, from its checkpoint ([] if none)."""
        return self.kubelet_node.kubelet.device_ids().get((pod_uid, container, RESOURCE), [])

    async def plugin_metric(self, name: str, **labels: str) -> float:
        found = samples(await scrape_text(f"http://127.0.0.1:{self.plugin.metrics_port}/metrics"))
        return found.get(sample_key(name, **labels), 0.0)


def allocated_slots(pod: dict[str, Any]) -> list[list[ContainerDevice]]:
    return decode_pod_devices(pod["metadata"]["annotations"][keys.DEVICES_ALLOCATED])


async def wait_advertised(api: Any, node: str, timeout_s: float = 60) -> dict[str, Any]:
    """The Node once its kubelet advertises the device plugin's GPUs (capacity above zero)."""
    core = CoreV1Api(api)

    async def advertised() -> dict[str, Any] | None:
        found = await core.read_node(node, _request_timeout=API_TIMEOUT_S)
        out: dict[str, Any] = api.sanitize_for_serialization(found)
        return out if (out["status"].get("capacity") or {}).get(RESOURCE) not in (None, "0") else None

    found: dict[str, Any] | None = await wait_for(
        advertised, timeout=timeout_s, interval=0.2, what=f"node {node} advertising {RESOURCE}"
    )
    assert found is not None
    return found


@contextlib.asynccontextmanager
async def gpu_node(
    devcluster: DevCluster,
    api: Any,
    namespace: str,
    workdir: Path,
    *,
    gpus: Sequence[FakeGpu],
    topology: Topology | None = None,
    extra_agents: Callable[[DevicePluginAgent], Sequence[Any]] = lambda _plugin: (),
    nvidia: Mapping[str, Any] | None = None,
    node_config: Mapping[str, Any] | None = None,
    real_runtime: bool = False,
) -> AsyncIterator[tuple[KubeletNode, DevicePluginAgent]]:
    """A GPU node ``<namespace>-gpu`` labelled ``gpu-test=<namespace>``: the real kubelet over the
    fake runtime, the device plugin process over ``gpus`` linked by ``topology`` (with ``nvidia``
    over its own hook and CDI directories, and ``node_config`` as the node's ``nodeConfigs`` entry)
    (and ``extra_agents(plugin)``, the monitor), Ready with its GPUs advertised. Its tracing follows
    this process's OTEL_* variables. With ``real_runtime``, over containerd and runc instead: its
    pods' containers really run."""
    node, plugin = gpu_kubelet_node(
        devcluster,
        api,
        f"{namespace}-gpu",
        workdir=workdir,
        gpus=gpus,
        topology=topology,
        nvidia=nvidia,
        node_config=node_config,
        native_build=NATIVE_BUILD,
        labels={"gpu-test": namespace},
        real_runtime=real_runtime,
    )
    node.agents.extend(extra_agents(plugin))
    async with node:
        await wait_advertised(api, node.name)
        yield node, plugin
        assert node.kubelet.running(), f"the kubelet or its runtime exited; see {node.kubelet.workdir}"


@contextlib.asynccontextmanager
async def running_gpu_stack(
    devcluster: DevCluster,
    api: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
    *,
    gpus: Sequence[FakeGpu],
    topology: Topology | None = None,
    real_runtime: bool = False,
    nvidia: Mapping[str, Any] | None = None,
    node_config: Mapping[str, Any] | None = None,
    monitor_args: Sequence[str] | None = None,
    config: Config | None = None,
) -> AsyncIterator[GpuStack]:
    """The webhook and one extender in this process (deciding by ``config``, the defaults when
    None), the hami-scheduler using it, and one GPU node (``gpu_node`` over ``gpus`` linked by
    ``topology``, its plugin's ``nvidia`` settings and ``node_config``; with the monitor when
    ``monitor_args`` are given; over containerd with ``real_runtime``). On exit the cluster must hold the GPU
    invariant."""
    # On real containers GPU pods get the node's NVIDIA runtime as the chart's webhook gives it.
    settings = None
    if real_runtime:
        await ensure_runtime_class(api, NVIDIA_HANDLER, NVIDIA_HANDLER)
        settings = MutationSettings(runtime_class_name=NVIDIA_HANDLER)
    # Unix socket paths must stay short (about 100 bytes): a directory under /tmp, not tmp_path.
    workdir = Path(tempfile.mkdtemp(prefix="hamipy-gpu-", dir="/tmp"))
    try:
        webhook = await start_webhook(api, namespace, workdir / "webhook", settings=settings)
        try:
            (extender,) = await start_extenders(api, config=config)
            try:
                await use_extender(hami_scheduler, extender.url)

                def monitor(plugin: DevicePluginAgent) -> list[MonitorAgent]:
                    return [] if monitor_args is None else [MonitorAgent(plugin, extra_args=monitor_args)]

                async with gpu_node(
                    devcluster,
                    api,
                    namespace,
                    workdir / "node",
                    gpus=gpus,
                    topology=topology,
                    nvidia=nvidia,
                    node_config=node_config,
                    real_runtime=real_runtime,
                    extra_agents=monitor,
                ) as (node, plugin):
                    yield GpuStack(api, namespace, node, plugin, extender)
                report = await check_cluster(RawKube(api))
                assert report.ok, report.violations
            finally:
                await extender.stop()
        finally:
            await stop_webhook(webhook)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
