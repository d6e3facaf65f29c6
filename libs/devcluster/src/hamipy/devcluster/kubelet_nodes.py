"""Dev-cluster nodes run by the real kubelet (``real_kubelet.RealKubelet``) and GPU nodes built on them.

A `KubeletNode` is what a joined node is: the kubelet registers the Node (with the labels given),
reports its status and renews its Lease; the node's agents (the device plugin, the monitor) start
once it is Ready and stop before it goes. The one thing done here that a cluster's controllers would
do is dropping the ``node.kubernetes.io/not-ready`` taint once the node is Ready: the node-lifecycle
controller is left out of the dev cluster (``config.CONTROLLERS``).

`gpu_kubelet_node` puts the real device plugin (over native/'s fake NVML) on such a node, serving
its socket in the kubelet's device-plugin directory, where the kubelet's device manager finds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol, Self

from hamipy.devcluster.containerd_runtime import NVIDIA_HANDLER, ContainerdRuntime
from hamipy.devcluster.errors import WaitTimeout
from hamipy.devcluster.fake_nvidia_toolkit import FakeNvidiaToolkit
from hamipy.devcluster.gpu_nodes import Credentials, DevicePluginAgent, FakeGpu, Topology
from hamipy.devcluster.images import ensure_images
from hamipy.devcluster.kubeobjects import ensure_runtime_class
from hamipy.devcluster.nodes import NamedNode, delete_node, remove_not_ready_taint
from hamipy.devcluster.real_kubelet import ContainerConfig, RealKubelet
from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.kube.errors import NotFound
from hamipy.kube.resources import node_path

if TYPE_CHECKING:
    from hamipy.devcluster.cluster import DevCluster

__all__ = ["KubeletAgent", "KubeletNode", "gpu_kubelet_node"]

READY_TIMEOUT_S: Final = 90.0


class KubeletAgent(Protocol):
    """Something that runs on a kubelet's node (the device plugin, the monitor)."""

    async def start(self, node: NamedNode) -> None: ...

    async def stop(self) -> None: ...


def _ready(node: Mapping[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


class KubeletNode:
    """One node: its kubelet and runtime, then its agents. ``async with`` starts and removes it."""

    def __init__(
        self,
        cluster: DevCluster,
        api: Any,
        name: str,
        workdir: Path,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[str] = (),
        agents: Sequence[KubeletAgent] = (),
        containerd: ContainerdRuntime | None = None,
    ) -> None:
        self.api = api
        self.kube = RawKube(api)
        self.kubelet = RealKubelet(
            cluster, name, workdir, labels=labels, taints=taints, containerd=containerd
        )
        self.agents = list(agents)
        self._started: list[KubeletAgent] = []

    @property
    def name(self) -> str:
        return self.kubelet.node

    async def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """The Node once its kubelet reports it Ready (and the not-ready taint is gone)."""

        async def ready() -> dict[str, Any] | None:
            try:
                node: dict[str, Any] = await self.kube.request("GET", node_path(self.name))
            except NotFound:
                return None
            if not _ready(node):
                return None
            return None if await remove_not_ready_taint(self.kube, node) else node

        found: dict[str, Any] | None = await wait_for(
            ready, timeout=timeout_s, interval=0.2, what=f"node {self.name} Ready"
        )
        assert found is not None  # wait_for returns the first truthy value
        return found

    async def wait_container(
        self, namespace: str, pod: str, container: str, *, timeout_s: float = READY_TIMEOUT_S
    ) -> ContainerConfig:
        """The config the kubelet created that container with (the fake runtime's record), once it
        has created it."""
        try:
            found: ContainerConfig | None = await wait_for(
                lambda: self.kubelet.container(namespace, pod, container),
                timeout=timeout_s,
                interval=0.1,
                what=f"the kubelet to create container {namespace}/{pod}/{container}",
            )
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; {self._records_in(namespace)}") from None
        assert found is not None  # wait_for returns the first truthy value
        return found

    def _records_in(self, namespace: str) -> str:
        """What the runtime recorded in ``namespace``: why a wait for a container found none."""
        path = self.kubelet.record_path
        try:  # the file may go while this looks (what once removed it is why this message exists)
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{path} does not exist"
        created = [
            f"{c.pod}/{c.container}#{c.attempt}"
            for c in self.kubelet.containers()
            if c.namespace == namespace
        ]
        return f"{path} ({size} bytes) holds in {namespace}: {', '.join(created) or 'nothing'}"

    async def start(self) -> None:
        containerd = self.kubelet.containerd
        if containerd is not None and containerd.nvidia is not None:
            await ensure_runtime_class(self.api, NVIDIA_HANDLER, NVIDIA_HANDLER)
        await asyncio.to_thread(self.kubelet.start)
        await self.wait_ready()
        if containerd is not None and containerd.network is not None:
            await asyncio.to_thread(self.kubelet.cluster.ensure_kube_proxy, self.name)
        for agent in self.agents:
            await agent.start(self)
            self._started.append(agent)

    async def restart_kubelet(self) -> None:
        """Stop and start the kubelet only (the runtime's containers and the agents keep running)."""
        await asyncio.to_thread(self.kubelet.restart_kubelet)
        await self.wait_ready()

    async def stop(self, *, delete: bool = True) -> None:
        """Stop the agents (newest first), the kubelet and its runtime; delete the Node and Lease."""
        try:
            while self._started:
                await self._started.pop().stop()
        finally:
            await asyncio.to_thread(self.kubelet.stop)
            if delete:
                await delete_node(self.kube, self.name)

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def gpu_kubelet_node(
    cluster: DevCluster,
    api: Any,
    name: str,
    *,
    workdir: Path,
    gpus: Sequence[FakeGpu],
    native_build: Path,
    labels: Mapping[str, str] | None = None,
    nvidia: Mapping[str, Any] | None = None,
    node_config: Mapping[str, Any] | None = None,
    topology: Topology | None = None,
    env: Mapping[str, str] | None = None,
    credentials: Credentials | None = None,
    real_runtime: bool = False,
) -> tuple[KubeletNode, DevicePluginAgent]:
    """A kubelet node with the real device plugin process over the fake driver's `gpus` (linked by
    the `topology` preset). Add more agents (the monitor) to ``node.agents`` before starting it.
    `workdir` holds the plugin's and the kubelet's unix sockets: keep its path short (about 60
    bytes at most). ``credentials`` (default: the cluster's admin kubeconfig) gives the plugin its
    own identity; ``env`` is added to its environment. With ``real_runtime`` the node runs
    containerd and runc (``ContainerdRuntime``, with the pause and GPU workload images), the
    toolkit stand-in (``FakeNvidiaToolkit``) putting the fake driver into GPU containers, and
    containerd reading the plugin's CDI specs too; without, the fake runtime."""
    plugin_dir = workdir / "plugin"
    containerd = None
    if real_runtime:
        images = ensure_images(native_build)
        containerd = ContainerdRuntime(
            workdir / "kubelet",
            node=name,
            image_archives=(images.pause.archive, images.gpu_workload.archive),
            nvidia=FakeNvidiaToolkit(plugin_dir / "driver" / "gpus.conf", native_build / "fake", tuple(gpus)),
            # The plugin's cdiSpecDir: under cdi-cri it writes the slots' specs there.
            cdi_spec_dirs=(plugin_dir / "cdi",),
            network=cluster.network,
        )
    node = KubeletNode(cluster, api, name, workdir / "kubelet", labels=labels, containerd=containerd)
    plugin = DevicePluginAgent(
        workdir=plugin_dir,
        gpus=gpus,
        kubeconfig=Path(cluster.access.kubeconfig),
        native_build=native_build,
        plugin_dir=node.kubelet.plugin_dir,
        pod_resources_socket=node.kubelet.pod_resources_socket,
        nvidia=nvidia,
        node_config=node_config,
        topology=topology,
        env=env,
        credentials=credentials,
    )
    node.agents.append(plugin)
    return node, plugin
