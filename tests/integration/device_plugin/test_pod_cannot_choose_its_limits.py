"""A GPU pod's own environment cannot lift the limits the device plugin gave it.

The kubelet passes the device plugin's env to the container first and the container's own after
it, and the container's wins. Admission refuses the limit variables in a pod's ``env``, but not what
an unprefixed ``envFrom`` of a ConfigMap brings (admission cannot read the ConfigMap, which may
change later anyway). So the pod here takes them from a ConfigMap, the real kubelet gives its
container those values over the plugin's, and a process run with exactly that environment, under
the interposer with the limits file the plugin mounted beside it, is still held to its slice
(docs/wire-format.md#limits-file).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import container
from kubernetes_asyncio.client import CoreV1Api
from stack_support import NATIVE_BUILD, NEEDS_REAL_KUBELET, GpuStack, allocated_slots

from hamipy.devcluster import API_TIMEOUT_S
from hamipy.devcluster.gpu_nodes import DevicePluginAgent, FakeGpu
from hamipy.devcluster.real_kubelet import ContainerConfig
from hamipy.protocol.region import build_region, parse_region

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPUS = (FakeGpu("GPU-ffffffff-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-40GB", 40960),)
MiB = 1024 * 1024


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hamipy-lift-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def alloc(env: dict[str, str], mib: int) -> subprocess.CompletedProcess[str]:
    """One process of the container allocating ``mib`` MiB (exit 0: allocated, 2: refused)."""
    return subprocess.run(
        [str(NATIVE_BUILD / "tests" / "region_peer"), "alloc", str(mib)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


async def test_limit_variables_from_a_config_map_do_not_lift_the_containers_limits(
    gpu_stack: GpuStack, scratch: Path
) -> None:
    private = scratch / "private.cache"
    lifted = {
        "CUDA_DEVICE_MEMORY_LIMIT_0": "40000m",
        "CUDA_DEVICE_SM_LIMIT": "0",
        "GPU_CORE_UTILIZATION_POLICY": "disable",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(private),
    }
    core: CoreV1Api = gpu_stack.core
    await core.create_namespaced_config_map(
        gpu_stack.namespace,
        {"metadata": {"name": "lift"}, "data": lifted},  # type: ignore[arg-type]
        _request_timeout=API_TIMEOUT_S,
    )
    body = gpu_stack.pod_body(
        "lifter",
        [container("main", gpu=1, gpumem=1000, gpucores=30, envFrom=[{"configMapRef": {"name": "lift"}}])],
    )
    await gpu_stack.create(body)
    pod = await gpu_stack.served("lifter")
    ((granted,),) = allocated_slots(pod)
    assert (granted.usedmem, granted.usedcores) == (1000, 30)
    config = await gpu_stack.container("lifter", "main")
    # The threat is real: the kubelet gave the container the ConfigMap's values over the plugin's.
    assert {name: config.envs[name] for name in lifted} == lifted

    await asyncio.to_thread(
        check_a_process_is_held_to_its_slice, config, gpu_stack.plugin, scratch, private, granted.usedmem
    )


def check_a_process_is_held_to_its_slice(
    config: ContainerConfig, plugin: DevicePluginAgent, scratch: Path, private: Path, mib: int
) -> None:
    """A process of the container: its environment as the kubelet made it, the interposer and the
    limits file as mounted (the host file the mount names), over the node's fake driver."""
    hook = scratch / "hook"
    hook.mkdir()
    shutil.copyfile(NATIVE_BUILD / "libvgpu.so", hook / "libvgpu.so")
    limits = config.mount(str(plugin.hook_path / "limits"))
    assert limits.read_only
    shutil.copyfile(limits.host_path, hook / "limits")
    env = {
        **config.envs,
        "PATH": "/usr/bin:/bin",
        "HAMIPY_FAKE_GPU_CONFIG": str(plugin.gpu_config_path),
        "LD_LIBRARY_PATH": str(NATIVE_BUILD / "fake"),
        "LD_PRELOAD": str(hook / "libvgpu.so"),
    }
    private.write_bytes(build_region(uuids=[GPUS[0].uuid]))  # the test program reads the one its env names

    refused = alloc(env, 2 * mib)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert alloc(env, mib // 2).returncode == 0
    # Its use went to the region the limits file names, not to the one its env points at.
    assert parse_region(private.read_bytes()).devices[0].used_bytes == 0
    settings = dict(line.split("=", 1) for line in Path(limits.host_path).read_text().splitlines())
    region = Path(settings["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    assert parse_region(region.read_bytes()).devices[0].limit_bytes == mib * MiB
