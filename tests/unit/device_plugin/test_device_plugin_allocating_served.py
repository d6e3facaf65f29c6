"""A container whose allocation takes a whole GPU (all its cores, all its memory) is served at
Allocate like any other, with limits that say so (docs/device-plugin.md, "Allocate")."""

from __future__ import annotations

import io
from pathlib import Path

import builders
import pytest
from plugin_fakes import NODE, FakePodResources, node_kube

from hamipy.device_plugin.allocator import Allocator
from hamipy.device_plugin.kube import NodeKube, node_pods_informer
from hamipy.device_plugin.pod_cache import PodCache
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.informer import InformerSettings
from hamipy.protocol import keys
from hamipy.protocol.config import load_config
from hamipy.protocol.devices import ContainerDevice

UUID = "GPU-aaaaaaaa-0000-4000-8000-000000000000"


@pytest.mark.parametrize(
    ("cores", "memory"),
    [(100, 1000), (100, 81920), (0, 81920)],
    ids=["all-cores", "all-cores-all-memory", "no-core-limit-all-memory"],
)
async def test_a_container_using_all_of_a_gpus_cores_is_served(
    tmp_path: Path, cores: int, memory: int
) -> None:
    devices = [[ContainerDevice(UUID, "NVIDIA", memory, cores)]]
    api = node_kube(
        builders.allocating_pod(
            "whole", builders.container("main", gpu=1), node=NODE, allocated=devices, to_allocate=devices
        )
    )
    config = load_config(f"nvidia:\n  hookPath: {tmp_path}/vgpu\n")
    telemetry = Telemetry.create(stream=io.StringIO())
    cache = PodCache(node_pods_informer(api, NODE, logger=telemetry.logger, settings=InformerSettings()))
    await cache.informer.list_once()
    allocator = Allocator(
        api=NodeKube(api, node_name=NODE),
        pods=cache,
        kubelet=FakePodResources(api).pods,
        nvidia=config.nvidia,
        node_settings=config.for_node(NODE),
        telemetry=telemetry,
        cache_id=lambda: "c0ffee",
    )
    (served,) = await allocator.allocate([[f"{UUID}-0"]])
    assert served.envs["NVIDIA_VISIBLE_DEVICES"] == UUID
    assert served.envs["CUDA_DEVICE_SM_LIMIT"] == str(cores)
    assert served.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{memory}m"
    annotations = api.pod("ns", "whole")["metadata"]["annotations"]
    assert annotations[keys.BIND_PHASE] == "success"
    assert annotations[keys.DEVICES_TO_ALLOCATE] == ";"
