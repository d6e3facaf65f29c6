"""The whole system deployed as an admin deploys it: the chart ``deploy/helm/hami-py`` installed with
helm into a dev cluster whose GPU nodes run containerd (``containerd_runtime``) on the cluster's pod
network (``cluster_network``: kube-proxy, and CoreDNS from ``cluster_dns``), every service a pod
from its image (``service_images``: the Dockerfiles as shipped).

What the chart needs from a GPU node is what a real one has: the label its DaemonSets select
(``gpu=on``), the NVIDIA runtime as RuntimeClass ``nvidia`` (the toolkit stand-in: the device plugin
and monitor get NVML from it, the webhook gives it to GPU pods), the kubelet's device-plugin and
PodResources directories, and a hook path of the node's own (``containerd_runtime`` shadows it).
The chart's values name these; nothing is set up behind its back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from hamipy.devcluster import binaries, cluster_dns
from hamipy.devcluster.containerd_runtime import NVIDIA_HANDLER, ContainerdRuntime
from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.fake_nvidia_toolkit import FakeNvidiaToolkit
from hamipy.devcluster.gpu_nodes import FakeGpu, GpuNodeModel, Topology, fake_gpu_config
from hamipy.devcluster.images import ensure_coredns_image, ensure_images
from hamipy.devcluster.kubelet_nodes import KubeletNode
from hamipy.devcluster.processes import http_ok
from hamipy.devcluster.service_images import CHART_DIR, ensure_service_images
from hamipy.kube.client import RawKube

__all__ = [
    "CHART_NAMESPACE",
    "CHART_NODE_LABELS",
    "RELEASE",
    "ChartStack",
    "Helm",
    "HelmError",
    "dev_values",
]

RELEASE: Final = "hami-py"
CHART_NAMESPACE: Final = "hami-system"
CHART_NODE_LABELS: Final[Mapping[str, str]] = MappingProxyType({"gpu": "on"})
"""What the chart's ``devicePlugin.nodeSelector`` selects by default."""
HELM_TIMEOUT: Final = "5m"
HELM_PROCESS_TIMEOUT_S: Final = 420.0
METRICS_COMPONENTS: Final = ("extender", "webhook", "device-plugin", "monitor")


class HelmError(DevClusterError):
    """A helm command failed; its output says why."""


@dataclasses.dataclass(frozen=True)
class Helm:
    """The pinned helm (``binaries.ensure_helm``) against one cluster."""

    kubeconfig: Path
    binary: Path = dataclasses.field(default_factory=binaries.ensure_helm)

    def run(self, *args: str, timeout_s: float = HELM_PROCESS_TIMEOUT_S) -> str:
        """Run ``helm args``; its stdout, or ``HelmError`` with its output."""
        # helm keeps a cache and config of its own: a temporary home keeps the user's untouched.
        with tempfile.TemporaryDirectory(prefix="hamipy-helm-") as home:
            env = {
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": home,
                "HELM_CACHE_HOME": f"{home}/cache",
                "HELM_CONFIG_HOME": f"{home}/config",
                "HELM_DATA_HOME": f"{home}/data",
                "KUBECONFIG": str(self.kubeconfig),
            }
            done = subprocess.run(
                [str(self.binary), *args],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout_s,
                check=False,
            )
        if done.returncode != 0:
            raise HelmError(
                f"helm {' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()[-3000:]}"
            )
        return done.stdout

    def deploy(
        self, chart: Path, values: Sequence[str], *, release: str = RELEASE, namespace: str = CHART_NAMESPACE
    ) -> str:
        """``helm upgrade --install --wait``: install, or upgrade to ``values``."""
        return self.run(
            "upgrade",
            "--install",
            release,
            str(chart),
            "--namespace",
            namespace,
            "--create-namespace",
            "--wait",
            "--timeout",
            HELM_TIMEOUT,
            *values,
        )

    def uninstall(self, *, release: str = RELEASE, namespace: str = CHART_NAMESPACE) -> str:
        return self.run("uninstall", release, "--namespace", namespace, "--wait", "--timeout", HELM_TIMEOUT)


def dev_values(*, otlp_endpoint: str | None = None) -> list[str]:
    """The values this dev cluster's nodes need, as a real cluster of the same kind would: the
    NVIDIA runtime is RuntimeClass ``nvidia``, not the nodes' default."""
    values = {
        "devicePlugin.runtimeClassName": NVIDIA_HANDLER,
        "monitor.runtimeClassName": NVIDIA_HANDLER,
        "webhook.runtimeClassName": NVIDIA_HANDLER,
    }
    if otlp_endpoint:
        values["tracing.otlpEndpoint"] = otlp_endpoint
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


class ChartStack:
    """GPU nodes on the pod network of ``cluster`` (a ``DevCluster`` with ``pod_network``), the
    cluster's DNS, and the chart installed on them; ``stop`` stops the nodes."""

    def __init__(
        self, cluster: Any, api: Any, *, root: Path, native_build: Path, otlp_endpoint: str | None = None
    ) -> None:
        if cluster.network is None:
            raise DevClusterError("ChartStack: the cluster has no pod network (ClusterSettings.pod_network)")
        self.cluster = cluster
        self.api = api
        self.root = root.resolve()
        self.native_build = native_build
        self.otlp_endpoint = otlp_endpoint
        self.helm = Helm(Path(cluster.access.kubeconfig))
        self.nodes: list[KubeletNode] = []
        self.gpu_nodes: list[str] = []
        # containerd's socket and the kubelet's plugin sockets live under it: keep it short.
        self.socket_root = Path(tempfile.mkdtemp(prefix="hamipy-chart-", dir="/tmp"))
        self._archives: tuple[Path, ...] = ()
        self._dns_image = ""
        self.node_configs: list[dict[str, str]] = []
        """The nodes' ``nodeConfigs`` entries (MIG nodes'), kept in every install's values."""

    @property
    def chart(self) -> Path:
        return self.root / CHART_DIR

    def values(self, *extra: str) -> list[str]:
        nodes = (
            ["--set-json", f"config.nodeConfigs={json.dumps(self.node_configs)}"] if self.node_configs else []
        )
        return [*dev_values(otlp_endpoint=self.otlp_endpoint), *nodes, *extra]

    async def prepare_images(self) -> None:
        """Build (when stale) every image the nodes run: the pause and workload images, the four
        services' and kube-scheduler's, CoreDNS."""
        workload = await asyncio.to_thread(ensure_images, self.native_build)
        services = await asyncio.to_thread(ensure_service_images, self.root)
        dns = await asyncio.to_thread(ensure_coredns_image)
        self._archives = (
            workload.pause.archive,
            workload.gpu_workload.archive,
            *(built.image.archive for built in services),
            dns.archive,
        )
        self._dns_image = dns.ref

    async def add_gpu_node(
        self, name: str, gpus: Sequence[FakeGpu], topology: Topology | None = None
    ) -> KubeletNode:
        """A GPU node as the chart expects one: containerd with the NVIDIA runtime, labelled for the
        chart's DaemonSets, no agent of ours (the chart's pods are the agents); its fake driver has
        ``gpus`` linked by ``topology``."""
        if not self._archives:
            await self.prepare_images()
        workdir = self.socket_root / name
        driver = workdir / "driver" / "gpus.conf"
        driver.parent.mkdir(parents=True, exist_ok=True)
        driver.write_text(fake_gpu_config(gpus, topology))
        containerd = ContainerdRuntime(
            workdir / "kubelet",
            node=name,
            image_archives=self._archives,
            nvidia=FakeNvidiaToolkit(driver, self.native_build / "fake", tuple(gpus)),
            network=self.cluster.network,
        )
        node = KubeletNode(
            self.cluster, self.api, name, workdir / "kubelet", labels=CHART_NODE_LABELS, containerd=containerd
        )
        self.nodes.append(node)
        await node.start()
        self.gpu_nodes.append(name)
        return node

    async def start(self, gpu_models: Sequence[GpuNodeModel], *, values: Sequence[str] = ()) -> None:
        """The nodes (one of each model), the cluster's DNS, then ``helm install --wait`` with
        ``values`` (helm arguments) after the dev values."""
        await self.prepare_images()
        for i, model in enumerate(gpu_models):
            name = f"hamipy-gpu-{i}"
            await self.add_gpu_node(name, model.gpus(i), model.topology)
            if model.node_config:
                self.node_configs.append({"name": name, **model.node_config})
        await cluster_dns.ensure_cluster_dns(
            self.api, cluster_ip=self.cluster.network.dns_ip, image=self._dns_image
        )
        await self.deploy(*values)

    async def deploy(self, *extra: str) -> str:
        """Install or upgrade the release with the dev values and ``extra`` (helm arguments)."""
        return await asyncio.to_thread(self.helm.deploy, self.chart, self.values(*extra))

    async def metrics_urls(self, component: str) -> dict[str, str]:
        """The ``/metrics`` URL of each running pod of the release's ``component`` (``extender``,
        ``device-plugin``...) by pod name: its port named ``metrics`` at its pod IP."""
        selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=hamipy-{component}"
        pods = await RawKube(self.api).request(
            "GET", f"/api/v1/namespaces/{CHART_NAMESPACE}/pods", query=[("labelSelector", selector)]
        )
        urls = {}
        for pod in pods.get("items", []):
            ip = pod.get("status", {}).get("podIP")
            ports = [
                p for c in pod["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == "metrics"
            ]
            if ip and ports:
                urls[pod["metadata"]["name"]] = f"http://{ip}:{ports[0]['containerPort']}/metrics"
        return urls

    async def endpoints(self) -> dict[str, str]:
        """What a user can look at: every service pod's metrics."""
        found = {}
        for component in METRICS_COMPONENTS:
            for pod, url in (await self.metrics_urls(component)).items():
                found[f"{component} {pod} /metrics"] = url
        return found

    async def quota_enforced(self, namespace: str) -> bool:
        """Whether the leading extender counts ``namespace``'s GPU quota (its metrics have it)."""
        text = f'hami_resource_quota_limit{{namespace="{namespace}"'.encode()
        for url in (await self.metrics_urls("extender")).values():
            if await asyncio.to_thread(http_ok(url, expect=text)):
                return True
        return False

    def kubelet_pids(self) -> dict[str, int]:
        return {name: pid for node in self.nodes for name, pid in node.kubelet.pids().items()}

    async def stop(self) -> None:
        while self.nodes:
            await self.nodes.pop().stop()
        await asyncio.to_thread(shutil.rmtree, self.socket_root, ignore_errors=True)
