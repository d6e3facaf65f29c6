"""Simulated GPU nodes: a Node + a fake NVML/CUDA configuration + the real device plugin process +
the kubelet stand-in driving it (docs/design.md#2-real-nodes-one-stand-in and
#3-real-nvml-or-a-fake-driver).

The device plugin runs as its own process (``python -m hamipy.device_plugin.cli``) with native/'s
fake ``libnvidia-ml.so.1`` first on its library path, so its ``pynvml`` discovery, health watch and
Allocate are the code a real node runs. Each node gets its own directory with the fake driver's
configuration (``gpus.conf``), the device-plugin directory (the stand-in's ``kubelet.sock``, its
PodResources ``pod-resources.sock`` and the plugin's socket), the hook directory (``hookPath``:
region directories and limits files of served containers), the CDI spec directory (``cdiSpecDir``:
the slots' specs under the ``cdi-cri`` strategy), the plugin's configuration and its log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from hamipy.devcluster.nodes import NamedNode, NodeAgent
from hamipy.devcluster.processes import ManagedProcess, free_port, http_ok

__all__ = [
    "Credentials",
    "DevicePluginAgent",
    "FakeGpu",
    "GpuNodeModel",
    "MigSetup",
    "MonitorAgent",
    "Topology",
    "fake_gpu_config",
    "gpu_node_agents",
]

Credentials = Callable[[str], Awaitable[Path]]
"""Given the node's name, a kubeconfig for an agent on it (``ServiceIdentities.kubeconfig``): the
agent then runs as its own ServiceAccount with a token bound to its node, as in a cluster."""

PLUGIN_START_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class FakeGpu:
    """One GPU of native/'s fake driver (see ``native/fake/fake.h`` for the file format)."""

    uuid: str
    name: str = "NVIDIA A100-SXM4-40GB"
    memory_mib: int = 40960
    numa: int = 0
    pci: str = ""
    healthy: bool = True
    mig_instances: str = ""
    """MIG instances the driver starts with (``3g.40gb@4,1g.10gb@0``: profile and first slice); a
    GPU given some starts in MIG mode."""


Topology = Literal["hgx8", "pcie-pairs8", "none"]
MigSetup = Literal["dynamic", "single", "mixed"]
"""How a node's device plugin serves MIG (docs/device-plugin.md#mig): ``dynamic`` makes an instance
for each pod (the node's ``operatingmode: mig``); ``single`` and ``mixed`` serve instances made
beforehand (its ``migstrategy``)."""
"""A preset of the fake driver's NVLinks and P2P levels (docs/isolation.md): GPUs 2k and 2k+1 of
``pcie-pairs8`` are NVLink-bridged pairs, every GPU of ``hgx8`` is on the NVSwitches."""


def fake_gpu_config(gpus: Sequence[FakeGpu], topology: Topology | None = None) -> str:
    """The fake driver's configuration file for ``gpus``, in NVML index order, linked by the
    ``topology`` preset (None: no NVLink, P2P levels by NUMA node)."""
    lines = [] if topology is None else [f"topology = {topology}"]
    for i, gpu in enumerate(gpus):
        pci = gpu.pci or f"00000000:{0x10 + i:02X}:00.0"
        lines.append(
            f'gpu uuid={gpu.uuid} name="{gpu.name}" memory={gpu.memory_mib}m numa={gpu.numa} pci={pci} '
            f"healthy={'true' if gpu.healthy else 'false'}"
            + (f" mig=on mig_instances={gpu.mig_instances}" if gpu.mig_instances else "")
        )
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class GpuNodeModel:
    """A kind of simulated GPU node: the GPU model, how many, memory, NUMA layout and links."""

    gpu_name: str
    count: int
    memory_mib: int
    numa_nodes: int = 1
    topology: Topology | None = None
    mig: MigSetup | None = None
    mig_instances: tuple[str, ...] = ()
    """Per GPU, by index, the MIG instances it starts with (``FakeGpu.mig_instances``)."""

    @property
    def node_config(self) -> dict[str, str]:
        """The node's ``nodeConfigs`` entry (its name left out) for the device plugin."""
        if self.mig == "dynamic":
            return {"operatingmode": "mig"}
        return {"migstrategy": self.mig} if self.mig else {}

    def gpus(self, node_index: int) -> list[FakeGpu]:
        per_numa = max(1, self.count // self.numa_nodes)
        return [
            FakeGpu(
                uuid=f"GPU-{node_index:08x}-0000-4000-8000-{i:012x}",
                name=self.gpu_name,
                memory_mib=self.memory_mib,
                numa=min(i // per_numa, self.numa_nodes - 1),
                mig_instances=self.mig_instances[i] if i < len(self.mig_instances) else "",
            )
            for i in range(self.count)
        ]


class DevicePluginAgent:
    """Runs ``hamipy-device-plugin`` for one simulated node over the fake driver (a ``NodeAgent``)."""

    def __init__(
        self,
        *,
        workdir: Path,
        gpus: Sequence[FakeGpu],
        kubeconfig: Path,
        native_build: Path,
        plugin_dir: Path,
        pod_resources_socket: Path,
        nvidia: Mapping[str, Any] | None = None,
        node_config: Mapping[str, Any] | None = None,
        topology: Topology | None = None,
        register_interval_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.workdir = workdir
        self.gpus = list(gpus)
        self.topology = topology
        self.kubeconfig = kubeconfig
        self.credentials = credentials
        self.native_build = native_build
        self.plugin_dir = plugin_dir
        self.pod_resources_socket = pod_resources_socket
        self.hook_path = workdir / "vgpu"
        self.cdi_spec_dir = workdir / "cdi"
        own = {"hookPath": str(self.hook_path), "cdiSpecDir": str(self.cdi_spec_dir)}
        self.nvidia = {**own, **(nvidia or {})}
        self.node_config = dict(node_config or {})
        """This node's ``nodeConfigs`` entry, its name left out (``operatingmode``, ``migstrategy``)."""
        self.register_interval_s = register_interval_s
        self.extra_env = dict(env or {})
        self.metrics_port: int | None = None
        self.process: ManagedProcess | None = None

    @property
    def gpu_config_path(self) -> Path:
        """The node's fake driver configuration (its state beside it, ``gpus.conf.state``)."""
        return self.workdir / "driver" / "gpus.conf"

    @property
    def config_path(self) -> Path:
        """The plugin's configuration (its ``nvidia`` section), written at ``start``."""
        return self.workdir / "hami-py.yaml"

    def _write_files(self, node: str) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hook_path.mkdir(exist_ok=True)
        self.gpu_config_path.parent.mkdir(exist_ok=True)
        self.gpu_config_path.write_text(fake_gpu_config(self.gpus, self.topology))
        config: dict[str, Any] = {"nvidia": dict(self.nvidia)}
        if self.node_config:
            config["nodeConfigs"] = [{"name": node, **self.node_config}]
        self.config_path.write_text(yaml.safe_dump(config))
        return self.config_path

    async def start(self, node: NamedNode) -> None:
        fake = self.native_build / "fake"
        if not (fake / "libnvidia-ml.so.1").is_file():
            raise FileNotFoundError(f"{fake}/libnvidia-ml.so.1 is missing: run `make native` first")
        config = await asyncio.to_thread(self._write_files, node.name)
        kubeconfig = self.kubeconfig if self.credentials is None else await self.credentials(node.name)
        self.metrics_port = free_port()
        env = self.node_env()
        self.process = ManagedProcess(
            f"device-plugin-{node.name}",
            [
                sys.executable,
                "-m",
                "hamipy.device_plugin.cli",
                "--node-name",
                node.name,
                "--kubeconfig",
                str(kubeconfig),
                "--config",
                str(config),
                "--plugin-dir",
                str(self.plugin_dir),
                "--pod-resources-socket",
                str(self.pod_resources_socket),
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(self.metrics_port),
                "--register-interval",
                str(self.register_interval_s),
                # Installed into the hook directory, as the chart's image does: a real runtime
                # mounts it into GPU containers.
                "--interposer",
                str(self.native_build / "libvgpu.so"),
            ],
            log_path=self.workdir / "device-plugin.log",
            env=env,
        )
        process = self.process
        process.start()
        await asyncio.to_thread(
            process.wait_healthy,
            http_ok(f"http://127.0.0.1:{self.metrics_port}/readyz", expect=b"ok"),
            timeout_s=PLUGIN_START_TIMEOUT_S,
            what="registered with the kubelet and the node",
        )

    def node_env(self) -> dict[str, str]:
        """The environment of a process on this node: the fake NVML/CUDA first on the library path,
        configured with this node's GPUs."""
        fake = self.native_build / "fake"
        return {
            **os.environ,
            "HAMIPY_FAKE_GPU_CONFIG": str(self.gpu_config_path),
            "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(fake), os.environ.get("LD_LIBRARY_PATH")])),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a crash in native code leaves a traceback in the log
            **self.extra_env,
        }

    async def stop(self) -> None:
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
            self.process = None

    async def kill(self) -> None:
        """SIGKILL the plugin (a crash: its socket stays behind, nothing is cleaned up); ``start``
        runs it again, as the DaemonSet would."""
        if self.process is not None:
            await asyncio.to_thread(self.process.kill)
            self.process = None

    def pause(self) -> None:
        """Freeze the plugin (SIGSTOP): the kubelet's calls to it wait, unanswered, until ``resume``
        or ``kill``."""
        if self.process is not None:
            self.process.pause()

    def resume(self) -> None:
        if self.process is not None:
            self.process.resume()

    async def set_health(self, uuid: str, *, healthy: bool) -> None:
        """Flip a GPU's health in the fake driver: NVML then reports an XID error for it."""
        self.gpus = [dataclasses.replace(g, healthy=healthy) if g.uuid == uuid else g for g in self.gpus]
        await asyncio.to_thread(self.gpu_config_path.write_text, fake_gpu_config(self.gpus, self.topology))


class MonitorAgent:
    """Runs ``hamipy-monitor`` on a simulated GPU node (a ``NodeAgent``; attach it after the
    plugin): the node's fake NVML for host metrics, the plugin's configuration (its hook directory
    for region files, its CDI spec directory and strategy)."""

    def __init__(
        self,
        plugin: DevicePluginAgent,
        *,
        extra_args: Sequence[str] = (),
        credentials: Credentials | None = None,
    ) -> None:
        self.plugin = plugin
        self.credentials = credentials
        self.extra_args = tuple(extra_args)
        self.port: int | None = None
        self.process: ManagedProcess | None = None
        self.node: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.plugin.workdir / "monitor.log"

    def running(self) -> bool:
        return self.process is not None and self.process.running()

    async def start(self, node: NamedNode) -> None:
        self.node = node.name
        kubeconfig = self.plugin.kubeconfig if self.credentials is None else await self.credentials(node.name)
        self.port = free_port()
        self.process = ManagedProcess(
            f"monitor-{node.name}",
            [
                sys.executable,
                "-m",
                "hamipy.monitor.cli",
                "--node-name",
                node.name,
                "--kubeconfig",
                str(kubeconfig),
                "--config",
                str(self.plugin.config_path),
                "--hook-path",
                str(self.plugin.hook_path),
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(self.port),
                *self.extra_args,
            ],
            log_path=self.log_path,
            env=self.plugin.node_env(),
        )
        process = self.process
        process.start()
        await asyncio.to_thread(
            process.wait_healthy,
            http_ok(f"{self.url}/readyz", expect=b"ok"),
            timeout_s=PLUGIN_START_TIMEOUT_S,
            what="serving with this node's pods listed",
        )

    async def stop(self) -> None:
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
            self.process = None


def gpu_node_agents(
    *,
    workdir: Path,
    gpus: Sequence[FakeGpu],
    kubeconfig: Path,
    native_build: Path,
    nvidia: Mapping[str, Any] | None = None,
    node_config: Mapping[str, Any] | None = None,
    topology: Topology | None = None,
    record_dir: Path | None = None,
    plugin_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    credentials: Credentials | None = None,
) -> tuple[NodeAgent, DevicePluginAgent]:
    """The two agents of a GPU node, in start order: the kubelet stand-in (it must be serving
    ``kubelet.sock`` first), then the device plugin over ``gpus`` linked by ``topology``. Pass both
    to ``NodePool.add(..., agents=...)``.
    ``plugin_dir`` (default ``<workdir>/device-plugins``) holds the unix sockets: keep its path short;
    ``env`` is added to the plugin's environment (``OTEL_*`` for trace export, say); ``credentials``
    (default: ``kubeconfig``, admin) gives the plugin its own identity."""
    from hamipy.devcluster.kubelet_standin import KubeletStandIn

    plugin_dir = plugin_dir if plugin_dir is not None else workdir / "device-plugins"
    standin = KubeletStandIn(plugin_dir, record_dir=record_dir)
    plugin = DevicePluginAgent(
        workdir=workdir,
        gpus=gpus,
        kubeconfig=kubeconfig,
        native_build=native_build,
        plugin_dir=plugin_dir,
        pod_resources_socket=standin.pod_resources_socket,
        nvidia=nvidia,
        node_config=node_config,
        topology=topology,
        env=env,
        credentials=credentials,
    )
    return standin, plugin
