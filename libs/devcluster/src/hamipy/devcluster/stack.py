"""The whole system for ``make up``: our services beside the control plane, and GPU nodes.

- the extender (``hamipy-extender serve``) on loopback over HTTPS that takes only kube-scheduler's
  client certificate, wired into a ``hami-scheduler`` kube-scheduler as its filter/bind extender
  (probes and metrics on a plain-HTTP port of their own);
- the webhook (``hamipy-webhook serve``) over TLS with a certificate from a CA made here, and the
  MutatingWebhookConfiguration it ships (``hamipy-webhook manifest``) pointing at it;
- five GPU nodes (``GPU_NODE_MODELS``: three GPU models, and 8-GPU nodes with the fake driver's
  NVSwitch and NVLink-pair presets), each run by the real kubelet over containerd and runc
  (``kubelet_nodes``, ``containerd_runtime``: the pods' containers really run, the fake driver put
  into GPU containers by the nodes' ``nvidia`` runtime, which the webhook gives GPU pods), with its
  real device plugin process over the fake NVML driver and the monitor process; where real kubelets
  cannot run (not root), simulated nodes with the kubelet stand-in instead, and a warning that says
  why (``gpu_nodes``);
- the admission policies that keep allocation state to the extender and the device plugins, GPU
  pods already placed to the extender, the reserved env out of every pod and GPU containers' own
  volumes off the device plugins' mounts (``hamipy-webhook manifest --policy``; no namespace is
  exempt, since the node agents run as processes), with each service running as its own
  ServiceAccount with the chart's rights (``identities``; the device plugins' tokens bound to their
  nodes). The nodes share one host, so each device plugin has a hook directory of its own under its
  work directory: the policies are installed once the nodes run, reserving every node's hook path
  and the default one the webhook (which runs without a configuration) reserves.

The services run as their own console-script processes: devcluster is a library below the
services and never imports them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from hamipy.devcluster.config import ExtenderConfig, ExtenderTLS, ManagedResource, SchedulerConfig
from hamipy.devcluster.containerd_runtime import NVIDIA_HANDLER
from hamipy.devcluster.gpu_nodes import (
    DevicePluginAgent,
    FakeGpu,
    GpuNodeModel,
    MonitorAgent,
    Topology,
    gpu_node_agents,
)
from hamipy.devcluster.identities import ServiceIdentities
from hamipy.devcluster.kubelet_nodes import KubeletNode, gpu_kubelet_node
from hamipy.devcluster.kubeobjects import API_TIMEOUT_S
from hamipy.devcluster.nodes import NodePool, NodeSpec
from hamipy.devcluster.pki import CERT_VALIDITY
from hamipy.devcluster.processes import ManagedProcess, free_port, http_ok
from hamipy.devcluster.real_kubelet import can_run_real_kubelets
from hamipy.kube.certs import issue_cert, make_ca
from hamipy.kube.client import RawKube
from hamipy.protocol.allocation_env import DEFAULT_HOOK_PATH

__all__ = ["GPU_NODE_LABELS", "GPU_NODE_MODELS", "LocalStack"]

log = logging.getLogger(__name__)

SERVICE_START_TIMEOUT_S: Final = 60.0
GPU_NODE_LABELS: Final[Mapping[str, str]] = MappingProxyType({"hami-py.io/gpu-node": "true"})
MANAGED_RESOURCES: Final = (
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
    "nvidia.com/priority",
)


GPU_NODE_MODELS: Final = (
    GpuNodeModel("NVIDIA A100-SXM4-80GB", count=4, memory_mib=81920, numa_nodes=2),
    GpuNodeModel("NVIDIA H100 80GB HBM3", count=2, memory_mib=81559),
    GpuNodeModel("Tesla T4", count=4, memory_mib=15360),
    # The fake driver's 8-GPU presets: every GPU on the NVSwitches, and NVLink-bridged pairs.
    GpuNodeModel("NVIDIA H100 80GB HBM3", count=8, memory_mib=81559, numa_nodes=2, topology="hgx8"),
    GpuNodeModel("NVIDIA A100 80GB PCIe", count=8, memory_mib=81920, numa_nodes=2, topology="pcie-pairs8"),
    # MIG: instances made for each pod that asks, and instances made beforehand (the first GPU's)
    # beside a GPU shared as usual.
    GpuNodeModel("NVIDIA A100-SXM4-40GB", count=2, memory_mib=40960, mig="dynamic"),
    GpuNodeModel(
        "NVIDIA H100 80GB HBM3",
        count=2,
        memory_mib=81559,
        mig="mixed",
        mig_instances=("3g.40gb@4,2g.20gb@0",),
    ),
)


def _service(name: str, argv: Sequence[str], workdir: Path, env: Mapping[str, str]) -> ManagedProcess:
    return ManagedProcess(
        name,
        [sys.executable, "-m", *argv],
        log_path=workdir / "logs" / f"{name}.log",
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )


class LocalStack:
    """Starts and stops the services and GPU nodes of ``make up`` on a running ``DevCluster``."""

    def __init__(
        self,
        cluster: Any,
        api: Any,
        pool: NodePool,
        *,
        native_build: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.env = dict(env or {})
        """Added to every service's environment (``OTEL_*`` for trace export)."""
        self.api = api
        self.pool = pool
        self.native_build = native_build
        self.workdir: Path = cluster.workdir / "stack"
        self.processes: list[ManagedProcess] = []
        self.extender_url = ""
        self.webhook_url = ""
        self.endpoints: dict[str, str] = {}
        """What a user can look at: service URLs and metrics endpoints, by name."""
        self.gpu_nodes: list[str] = []
        self.kubelet_nodes: list[KubeletNode] = []
        self.real_kubelets_unavailable = can_run_real_kubelets()
        """Why the GPU nodes are simulated (with the kubelet stand-in), or None: real kubelets."""
        # Unix socket paths are limited to 107 bytes: the nodes' device-plugin directories live in
        # a short directory of their own, not under the (possibly deep) state directory.
        self.socket_root = Path(tempfile.mkdtemp(prefix="hamipy-up-", dir="/tmp"))
        access = cluster.access
        self.identities = ServiceIdentities(
            api, server=access.server, ca_file=access.ca_file, workdir=self.workdir
        )

    async def start(self, *, models: Sequence[GpuNodeModel] = GPU_NODE_MODELS) -> None:
        await self.start_extender()
        await self.start_webhook()
        hook_paths = [DEFAULT_HOOK_PATH]
        for i, model in enumerate(models):
            plugin = await self.add_gpu_node(
                f"hamipy-gpu-{i}", model.gpus(i), model.topology, node_config=model.node_config
            )
            hook_paths.append(str(plugin.hook_path))
        await self.install_admission_policies(hook_paths)

    async def _run(self, process: ManagedProcess, probe_url: str, what: str) -> None:
        self.processes.append(process)
        process.start()
        await asyncio.to_thread(
            process.wait_healthy,
            http_ok(probe_url, expect=b"ok"),
            timeout_s=SERVICE_START_TIMEOUT_S,
            what=what,
        )

    async def install_admission_policies(self, hook_paths: Sequence[str]) -> None:
        """The chart's policies for this stack's identities: from here on only the extender (and
        the device plugins, their own keys on their own nodes) write allocation state or create GPU
        pods already placed, no pod sets the reserved env, and no GPU container mounts a volume
        over ``hook_paths`` (where the device plugins mount the interposer)."""
        printed = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "hamipy.webhook.cli",
                "manifest",
                "--policy",
                "--format",
                "json",
                "--scheduler-user",
                self.identities.user("extender"),
                "--device-plugin-user",
                self.identities.user("device-plugin"),
                *(arg for path in hook_paths for arg in ("--hook-path", path)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        kube = RawKube(self.api)
        for doc in json.loads(printed.stdout):
            plural = (
                "validatingadmissionpolicybindings"
                if doc["kind"].endswith("Binding")
                else "validatingadmissionpolicies"
            )
            await kube.request(
                "POST", f"/apis/admissionregistration.k8s.io/v1/{plural}", body=doc, timeout_s=API_TIMEOUT_S
            )

    def _extender_certificates(self) -> tuple[Path, ExtenderTLS]:
        """A CA of the extender's own, its serving certificate, and kube-scheduler's client
        certificate (the chart makes the same three): only the scheduler may call filter and bind."""
        certs = self.workdir / "extender-tls"
        certs.mkdir(parents=True, exist_ok=True)
        ca = make_ca("hamipy-extender-ca", validity=CERT_VALIDITY)
        serving = issue_cert(
            ca, common_name="hamipy-extender", validity=CERT_VALIDITY, ip_addresses=["127.0.0.1"], server=True
        )
        client = issue_cert(ca, common_name="hami-scheduler", validity=CERT_VALIDITY, client=True)
        for name, data in (
            ("ca.crt", ca.cert_pem),
            ("tls.crt", serving.cert_pem),
            ("tls.key", serving.key_pem),
            ("client.crt", client.cert_pem),
            ("client.key", client.key_pem),
        ):
            (certs / name).write_bytes(data)
            if name.endswith(".key"):
                (certs / name).chmod(0o600)
        tls = ExtenderTLS(
            ca_file=str(certs / "ca.crt"),
            cert_file=str(certs / "client.crt"),
            key_file=str(certs / "client.key"),
        )
        return certs, tls

    async def start_extender(self) -> None:
        port, metrics_port = free_port(), free_port()
        kubeconfig = str(await self.identities.kubeconfig("extender"))
        certs, tls = await asyncio.to_thread(self._extender_certificates)
        process = _service(
            "hamipy-extender",
            [
                "hamipy.extender.cli",
                "serve",
                "--kubeconfig",
                kubeconfig,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--tls-cert-file",
                str(certs / "tls.crt"),
                "--tls-key-file",
                str(certs / "tls.key"),
                "--tls-client-ca-file",
                str(certs / "ca.crt"),
            ],
            self.workdir,
            self.env,
        )
        metrics = f"http://127.0.0.1:{metrics_port}"
        await self._run(process, f"{metrics}/readyz", "synced with the cluster (GET /readyz)")
        self.extender_url = f"https://127.0.0.1:{port}"
        self.endpoints["extender (filter/bind: kube-scheduler's client certificate only)"] = self.extender_url
        self.endpoints["extender /metrics"] = f"{metrics}/metrics"
        extender = ExtenderConfig(
            url_prefix=self.extender_url,
            filter_verb="filter",
            bind_verb="bind",
            preempt_verb="preempt",
            node_cache_capable=True,
            managed_resources=tuple(ManagedResource(name) for name in MANAGED_RESOURCES),
            http_timeout_s=30,
            tls=tls,
        )
        await asyncio.to_thread(self.cluster.start_scheduler, SchedulerConfig.hami(extender), name="hami")

    async def start_webhook(self) -> None:
        from kubernetes_asyncio.client import AdmissionregistrationV1Api

        certs = self.workdir / "webhook"
        certs.mkdir(parents=True, exist_ok=True)
        ca = make_ca("hamipy-webhook-ca", validity=CERT_VALIDITY)
        serving = issue_cert(
            ca, common_name="hamipy-webhook", validity=CERT_VALIDITY, ip_addresses=["127.0.0.1"], server=True
        )
        for name, data in (
            ("ca.crt", ca.cert_pem),
            ("tls.crt", serving.cert_pem),
            ("tls.key", serving.key_pem),
        ):
            (certs / name).write_bytes(data)
        (certs / "tls.key").chmod(0o600)
        port, metrics_port = free_port(), free_port()
        process = _service(
            "hamipy-webhook",
            [
                "hamipy.webhook.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--cert-file",
                str(certs / "tls.crt"),
                "--key-file",
                str(certs / "tls.key"),
                # GPU pods get the nodes' NVIDIA runtime, which puts the driver into them.
                *(["--runtime-class-name", NVIDIA_HANDLER] if self.real_kubelets_unavailable is None else []),
            ],
            self.workdir,
            self.env,
        )
        await self._run(process, f"http://127.0.0.1:{metrics_port}/readyz", "ready (GET /readyz)")
        self.webhook_url = f"https://127.0.0.1:{port}/webhook"
        self.endpoints["webhook"] = self.webhook_url
        self.endpoints["webhook /metrics"] = f"http://127.0.0.1:{metrics_port}/metrics"
        manifest = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "hamipy.webhook.cli",
                "manifest",
                "--url",
                self.webhook_url,
                "--ca-file",
                str(certs / "ca.crt"),
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        admission: Any = AdmissionregistrationV1Api(self.api)
        await admission.create_mutating_webhook_configuration(
            json.loads(manifest.stdout), _request_timeout=API_TIMEOUT_S
        )

    async def add_gpu_node(
        self,
        name: str,
        gpus: Sequence[FakeGpu],
        topology: Topology | None = None,
        *,
        node_config: Mapping[str, Any] | None = None,
    ) -> DevicePluginAgent:
        """A GPU node with its device plugin and monitor (over ``gpus`` linked by ``topology``, its
        plugin given ``node_config`` as the node's ``nodeConfigs`` entry): on the real kubelet where
        it can run."""

        def plugin_identity(node: str) -> Any:
            return self.identities.kubeconfig("device-plugin", bound_node=node)

        plugin: DevicePluginAgent
        if self.real_kubelets_unavailable is None:
            node, plugin = gpu_kubelet_node(
                self.cluster,
                self.api,
                name,
                workdir=self.socket_root / name,
                gpus=gpus,
                topology=topology,
                node_config=node_config,
                native_build=self.native_build,
                labels=GPU_NODE_LABELS,
                env=self.env,
                credentials=plugin_identity,
                real_runtime=True,
            )
            monitor = self._monitor(plugin)
            node.agents.append(monitor)
            self.kubelet_nodes.append(node)
            await node.start()
        else:
            log.warning(
                "GPU node %s is simulated, with the kubelet stand-in: %s",
                name,
                self.real_kubelets_unavailable,
            )
            standin, plugin = gpu_node_agents(
                workdir=self.workdir / name,
                gpus=gpus,
                topology=topology,
                node_config=node_config,
                kubeconfig=Path(self.cluster.access.kubeconfig),
                native_build=self.native_build,
                record_dir=self.workdir / name / "allocations",
                plugin_dir=self.socket_root / name,
                env=self.env,
                credentials=plugin_identity,
            )
            monitor = self._monitor(plugin)
            await self.pool.add(
                NodeSpec(name=name, labels=GPU_NODE_LABELS), agents=(standin, plugin, monitor)
            )
        self.gpu_nodes.append(name)
        self.endpoints[f"device plugin {name} /metrics"] = f"http://127.0.0.1:{plugin.metrics_port}/metrics"
        self.endpoints[f"monitor {name} /metrics"] = f"{monitor.url}/metrics"
        return plugin

    async def quota_enforced(self, namespace: str) -> bool:
        """Whether the extender counts ``namespace``'s GPU quota: its ``hami_resource_quota_limit``
        gauge has the namespace."""
        text = f'hami_resource_quota_limit{{namespace="{namespace}"'
        probe = http_ok(self.endpoints["extender /metrics"], expect=text.encode())
        return await asyncio.to_thread(probe)

    def kubelet_pids(self) -> dict[str, int]:
        """The GPU nodes' kubelet and runtime processes by name, for `down` to find any left over."""
        return {name: pid for node in self.kubelet_nodes for name, pid in node.kubelet.pids().items()}

    def _monitor(self, plugin: DevicePluginAgent) -> MonitorAgent:
        return MonitorAgent(plugin, credentials=lambda _node: self.identities.kubeconfig("monitor"))

    async def stop(self) -> None:
        """Stop the GPU nodes (their plugins first), then the services, newest first."""
        while self.kubelet_nodes:
            await self.kubelet_nodes.pop().stop()
        for name in reversed(self.gpu_nodes):
            if name in self.pool.nodes:
                await self.pool.remove(name)
        self.gpu_nodes.clear()
        while self.processes:
            await asyncio.to_thread(self.processes.pop().stop)
        await asyncio.to_thread(shutil.rmtree, self.socket_root, ignore_errors=True)
