"""Benchmark: Allocate latency over gRPC against the real apiserver (target p99 <= 50 ms).

Run as a script: ``.venv/bin/python tests/bench/bench_allocate.py [--pods N]``. It starts a devcluster
(binaries built on first use), one Node, and ``--pods`` pods bound to it that wait for their
devices (``bind-phase=allocating``, as the extender leaves them); then the device plugin's real
gRPC service, on a unix socket in this process, serves one Allocate per pod, called by a gRPC
client as the kubelet would. Each Allocate asks the kubelet's PodResources API which pod it is
admitting (a ``List`` over a unix socket, answered here as the kubelet would: the pods admitted so
far with their devices, and the one being admitted), finds the pod in the plugin's watch-fed pod
cache, writes its limits file, patches the pod, and reads the node again to release a lock: the
node holds ``--pods`` pods throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).parent))

from _results import percentiles_us, record

from hamipy.devcluster import DevCluster, NodePool, NodeSpec, wait_for_default_service_account
from hamipy.devcluster.binaries import ensure_binaries
from hamipy.devcluster.cluster import ClusterSettings
from hamipy.device_plugin.allocator import Allocator
from hamipy.device_plugin.devices import Gpu
from hamipy.device_plugin.inventory import Inventory
from hamipy.device_plugin.kube import NodeKube, node_pods_informer
from hamipy.device_plugin.kubelet_pods import PodResourcesClient
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.servicer import DevicePluginServicer
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube import InformerSettings, RawKube
from hamipy.kubelet_api.podresources_v1 import api_pb2 as podresources_pb2
from hamipy.kubelet_api.podresources_v1 import api_pb2_grpc as podresources_pb2_grpc
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc
from hamipy.protocol import keys
from hamipy.protocol.config import Config, load_config

TARGET_P99_US = 50_000.0
NODE = "bench-gpu-node"
GPU = Gpu(
    index=0,
    uuid="GPU-00000000-0000-4000-8000-00000000be00",
    name="NVIDIA A100",
    memory_mib=81920,
    numa=0,
    pci_bus_id="00000000:10:00.0",
)


def pending_pod(i: int) -> dict[str, Any]:
    slot = f"{GPU.uuid},NVIDIA,1000,10:;"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"pod-{i:04d}",
            "annotations": {
                keys.BIND_PHASE: "allocating",
                keys.BIND_TIME: str(1_700_000_000 + i),
                keys.VGPU_NODE: NODE,
                keys.DEVICES_ALLOCATED: slot,
                keys.DEVICES_TO_ALLOCATE: slot,
            },
        },
        "spec": {
            "nodeName": NODE,
            "schedulerName": "hami-scheduler",
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/app:1",
                    "resources": {"limits": {keys.RESOURCE_COUNT: "1"}},
                }
            ],
        },
    }


class Kubelet(podresources_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources ``List`` while it admits ``pod-0000``, ``pod-0001``, ... in turn:
    ``admitted`` pods hold a device, the next one is being admitted."""

    def __init__(self) -> None:
        self.admitted = 0

    async def List(
        self, request: podresources_pb2.ListPodResourcesRequest, context: Any
    ) -> podresources_pb2.ListPodResourcesResponse:
        response = podresources_pb2.ListPodResourcesResponse()
        for i in range(self.admitted + 1):
            pod = response.pod_resources.add(name=f"pod-{i:04d}", namespace="default")
            main = pod.containers.add(name="main")
            if i < self.admitted:
                main.devices.add(resource_name=keys.RESOURCE_COUNT, device_ids=[f"{GPU.uuid}-{i % 10}"])
        return response


async def run(pods: int) -> dict[str, Any]:
    from kubernetes_asyncio.client import CoreV1Api

    with (
        tempfile.TemporaryDirectory(prefix="hamipy-bench-", dir="/tmp") as tmp,
        DevCluster(ClusterSettings(), binaries=ensure_binaries()) as cluster,
    ):
        async with cluster.api_client() as api, NodePool(api) as pool:
            await pool.add(NodeSpec(name=NODE))
            await wait_for_default_service_account(api, "default")
            core: Any = CoreV1Api(api)  # its hint asks for a V1Pod; the client sends a JSON body as it is
            for i in range(pods):
                await core.create_namespaced_pod("default", pending_pod(i))
            config: Config = load_config(f"nvidia:\n  hookPath: {tmp}/vgpu\n")
            telemetry = Telemetry.create(stream=io.StringIO())
            kube = RawKube(api)
            node_api = NodeKube(kube, node_name=NODE, timeout_s=10)
            pods_cache = PodCache(
                node_pods_informer(kube, NODE, logger=telemetry.logger, settings=InformerSettings())
            )
            watch = asyncio.create_task(pods_cache.run(), name="bench-pod-watch")
            await pods_cache.synced.wait()
            kubelet = Kubelet()
            kubelet_server = grpc.aio.server()
            podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(kubelet, kubelet_server)
            kubelet_server.add_insecure_port(f"unix://{tmp}/pod-resources.sock")
            await kubelet_server.start()
            pod_resources = PodResourcesClient(
                Path(tmp) / "pod-resources.sock", keys.RESOURCE_COUNT, timeout_s=10
            )
            allocator = Allocator(
                api=node_api,
                pods=pods_cache,
                kubelet=pod_resources.pods,
                nvidia=config.nvidia,
                node_settings=config.for_node(NODE),
                telemetry=telemetry,
            )
            servicer = DevicePluginServicer(
                inventory=Inventory([GPU], config.for_node(NODE)), allocator=allocator, telemetry=telemetry
            )
            server = grpc.aio.server()
            api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)
            socket = f"{tmp}/plugin.sock"
            server.add_insecure_port(f"unix://{socket}")
            await server.start()
            samples = []
            try:
                async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
                    stub = api_pb2_grpc.DevicePluginStub(channel)
                    request = api_pb2.AllocateRequest(
                        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[f"{GPU.uuid}-0"])]
                    )
                    for _ in range(pods):
                        started = time.perf_counter()
                        response = await stub.Allocate(request, timeout=10)
                        samples.append(time.perf_counter() - started)
                        assert response.container_responses[0].envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"
                        kubelet.admitted += 1
            finally:
                await server.stop(None)
                await pod_resources.close()
                await kubelet_server.stop(None)
                watch.cancel()
    figures: dict[str, Any] = {"pods_on_node": pods, "allocations": len(samples), **percentiles_us(samples)}
    figures["target_p99_us"] = TARGET_P99_US
    figures["met"] = figures["p99_us"] <= TARGET_P99_US
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=100, help="pods waiting on the node (one Allocate each)")
    args = parser.parse_args()
    record("device_plugin_allocate", asyncio.run(run(args.pods)))


if __name__ == "__main__":
    main()
