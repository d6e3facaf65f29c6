"""The device plugins of ``bench_e2e``'s simulated nodes, in a process of its own (its CPU is where
the nodes' device plugins' would be, beside the control plane's and the extender's).

``python _device_plugins.py KUBECONFIG NAMESPACE HOOK_DIR``: watches the pods of ``NAMESPACE``;
each one bound to a node with ``hami.io/bind-phase=allocating`` is served as that node's kubelet
would have it served at Allocate, by the device plugin's own ``Allocator``
(``hamipy.device_plugin.allocator``), one per node: it finds the pod in line, writes the
container's limits file under ``HOOK_DIR``, patches the pod (``vgpu-devices-to-allocate`` emptied,
``bind-phase=success``) and releases the node lock if the pod holds it. The kubelet admits one pod
of a node at a time, asking for one fake device on each GPU the scheduler planned. What the plugin
does apart from Allocate (registration, health) is left out: it writes nothing per pod.

Prints ``ready`` once the watch has listed; on stdin's close prints ``{"allocated": N, "failed": N}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from hamipy.device_plugin.allocating import PHASE_ALLOCATING, KubeletPod, KubeletPods, ServeRules
from hamipy.device_plugin.allocator import Allocator
from hamipy.device_plugin.errors import DevicePluginError
from hamipy.device_plugin.kube import NodeKube, node_pods_informer
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.client import KubeApi, RawKube, api_client
from hamipy.kube.errors import KubeError
from hamipy.kube.informer import ChangeKind, Informer, InformerSettings
from hamipy.protocol import decode_pod_devices, keys
from hamipy.protocol.config import Config


class Node:
    """One simulated node's device plugin and kubelet: its pods in line are served one at a time."""

    def __init__(self, api: KubeApi, name: str, config: Config, telemetry: Telemetry) -> None:
        self.admitting: KubeletPods = {}
        self.pods = PodCache(
            node_pods_informer(api, name, logger=telemetry.logger, settings=InformerSettings())
        )
        self.allocator = Allocator(
            api=NodeKube(api, node_name=name),
            pods=self.pods,
            kubelet=self._kubelet,
            nvidia=config.nvidia,
            node_settings=config.for_node(name),
            telemetry=telemetry,
            rules=ServeRules(scheduler_name=config.scheduler_name, names=config.nvidia.resource_names),
        )
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def _kubelet(self) -> KubeletPods:
        return self.admitting

    async def run(self, counts: dict[str, int]) -> None:
        while True:
            pod = await self.queue.get()
            meta = pod["metadata"]
            # The node's own informer is not run: the shared watch feeds it what it would see.
            self.pods.remember(pod)
            self.admitting = {
                (meta["namespace"], meta["name"]): KubeletPod(meta["namespace"], meta["name"], {})
            }
            slots = decode_pod_devices(meta["annotations"][keys.DEVICES_TO_ALLOCATE])
            try:
                for slot in slots:
                    if slot:
                        await self.allocator.allocate([[f"{d.uuid}-0" for d in slot]])
                counts["allocated"] += 1
            except (DevicePluginError, KubeError) as exc:
                counts["failed"] += 1
                print(f"allocate {meta['name']}: {exc}", file=sys.stderr, flush=True)


class Plugins:
    """The watch of the namespace's pods, handing each pod in line to its node."""

    def __init__(self, api: KubeApi, config: Config, telemetry: Telemetry) -> None:
        self.api, self.config, self.telemetry = api, config, telemetry
        self.nodes: dict[str, Node] = {}
        self.seen: set[str] = set()
        self.tasks: list[asyncio.Task[None]] = []
        self.counts = {"allocated": 0, "failed": 0}

    def listed(self, objects: list[dict[str, Any]]) -> None:
        for obj in objects:
            self.changed("ADDED", obj)

    def changed(self, kind: ChangeKind, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        node = (obj.get("spec") or {}).get("nodeName")
        if kind == "DELETED" or not node or meta.get("uid") in self.seen:
            return
        if (meta.get("annotations") or {}).get(keys.BIND_PHASE) != PHASE_ALLOCATING:
            return
        self.seen.add(meta["uid"])
        if node not in self.nodes:
            self.nodes[node] = Node(self.api, node, self.config, self.telemetry)
            self.tasks.append(asyncio.create_task(self.nodes[node].run(self.counts)))
        self.nodes[node].queue.put_nowait(obj)


async def main(kubeconfig: str, namespace: str, hook_dir: str, logs: TextIO) -> None:
    config = Config.model_validate({"nvidia": {"hookPath": hook_dir}})
    telemetry = Telemetry.create(stream=logs)
    async with await api_client(kubeconfig) as client:
        api = RawKube(client)
        plugins = Plugins(api, config, telemetry)
        informer = Informer(api, f"/api/v1/namespaces/{namespace}/pods", logger=telemetry.logger, keep=False)
        informer.subscribe(plugins)
        watch = asyncio.create_task(informer.run())
        await informer.listed.wait()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        watch.cancel()
        for task in plugins.tasks:
            task.cancel()
        await asyncio.gather(watch, *plugins.tasks, return_exceptions=True)
    print(json.dumps(plugins.counts), flush=True)


if __name__ == "__main__":
    with Path(os.devnull).open("w") as devnull:  # a plugin's log lines are made, as in a cluster
        kubeconfig, namespace, hook_dir = sys.argv[1:4]
        asyncio.run(main(kubeconfig, namespace, hook_dir, devnull))
