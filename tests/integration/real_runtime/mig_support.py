"""What a node's fake driver holds of MIG, read (and, for a crash's leftovers, changed) through real
``pynvml`` in a process of the node's own: the driver's shared state is where the device plugin
makes and destroys instances, so this sees what it did, not what it says it did."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

from hamipy.devcluster.gpu_nodes import DevicePluginAgent

__all__ = ["MigInstance", "make_instance", "mig_instances"]

NVML_TIMEOUT_S = 30.0

MigInstance = dict[str, Any]
"""``gpu`` (NVML index), ``uuid`` (``MIG-...``), ``gpu_instance_id``, ``compute_instance_id``,
``memory_mib`` and ``name`` of one live MIG device."""

_LIST = """
import json, pynvml as n
n.nvmlInit()
found = []
for i in range(n.nvmlDeviceGetCount()):
    gpu = n.nvmlDeviceGetHandleByIndex(i)
    try:
        current, _pending = n.nvmlDeviceGetMigMode(gpu)
    except n.NVMLError_NotSupported:
        continue
    if current != n.NVML_DEVICE_MIG_ENABLE:
        continue
    for k in range(n.nvmlDeviceGetMaxMigDeviceCount(gpu)):
        try:
            mig = n.nvmlDeviceGetMigDeviceHandleByIndex(gpu, k)
        except n.NVMLError_NotFound:
            continue
        uuid = n.nvmlDeviceGetUUID(mig)
        found.append({
            "gpu": i,
            "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
            "gpu_instance_id": n.nvmlDeviceGetGpuInstanceId(mig),
            "compute_instance_id": n.nvmlDeviceGetComputeInstanceId(mig),
            "memory_mib": n.nvmlDeviceGetMemoryInfo(mig).total >> 20,
            "name": (lambda v: v.decode() if isinstance(v, bytes) else v)(n.nvmlDeviceGetName(mig)),
        })
print(json.dumps(found))
"""

_MAKE = """
import json, sys, pynvml as n
n.nvmlInit()
gpu = n.nvmlDeviceGetHandleByIndex(int(sys.argv[1]))
slices = int(sys.argv[2])
gi_profile = getattr(n, f"NVML_GPU_INSTANCE_PROFILE_{slices}_SLICE")
ci_profile = getattr(n, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE")
if n.nvmlDeviceGetMigMode(gpu)[0] != n.NVML_DEVICE_MIG_ENABLE:
    n.nvmlDeviceSetMigMode(gpu, n.NVML_DEVICE_MIG_ENABLE)
info = n.nvmlDeviceGetGpuInstanceProfileInfo(gpu, gi_profile)
gi = n.nvmlDeviceCreateGpuInstance(gpu, info.id)
ci_info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gi, ci_profile, n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
)
n.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
print(json.dumps(n.nvmlGpuInstanceGetInfo(gi).id))
"""


def _run(plugin: DevicePluginAgent, script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=plugin.node_env(),
        capture_output=True,
        text=True,
        timeout=NVML_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def mig_instances(plugin: DevicePluginAgent) -> list[MigInstance]:
    """Every live MIG device on ``plugin``'s node, GPU by GPU."""
    found: list[MigInstance] = json.loads(await asyncio.to_thread(_run, plugin, _LIST))
    return found


async def make_instance(plugin: DevicePluginAgent, gpu: int, slices: int) -> int:
    """An instance of ``slices`` slices on GPU ``gpu`` (its GPU and compute instance) made behind
    the device plugin's back, as a plugin killed between making one and recording it leaves it;
    the GPU instance's id."""
    gi_id: int = json.loads(await asyncio.to_thread(_run, plugin, _MAKE, str(gpu), str(slices)))
    return gi_id
