"""GPU pods whose devices come by CDI, in real containers: with the device plugin's ``cdi-cri``
strategy (docs/device-plugin.md#cdi) the kubelet hands containerd only the CDI names of the slot
and its GPUs; containerd resolves them from the plugin's spec directory (the slot: env, limits
file, interposer) and the toolkit stand-in's (the GPUs: the fake driver, each GPU as the container
sees it), and the process is held to its slice on exactly its own GPUs.
"""

from __future__ import annotations

import pytest
from runtime_support import NEEDS_REAL_KUBELET, RuntimeStack, sees_only

from hamipy.devcluster.fake_nvidia_runtime import CONFIG_ENV
from hamipy.devcluster.fake_nvidia_toolkit import CONFIG_DIR_IN_CONTAINER
from hamipy.devcluster.gpu_nodes import FakeGpu

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPUS = tuple(
    FakeGpu(f"GPU-cdc0cdc0-0000-4000-8000-00000000000{i}", "NVIDIA A100-SXM4-40GB", 40960) for i in range(3)
)
NVIDIA = {"deviceListStrategy": "cdi-cri"}


async def test_a_pods_slot_and_gpu_come_by_cdi_and_its_process_is_held_to_its_slice(
    runtime_stack: RuntimeStack,
) -> None:
    log, (device,) = await runtime_stack.run_workload("one", gpu=1, gpumem=3000, gpucores=30)

    # One GPU, its own, at its own size, refused past it; the interposer in front of the driver.
    sees_only(log, [device.uuid], 3000)
    assert await runtime_stack.loaded_the_interposer("one")
    # The slot's spec put the limits in; the toolkit's came after it.
    env = await runtime_stack.env("one")
    assert (env["CUDA_DEVICE_MEMORY_LIMIT_0"], env["CUDA_DEVICE_SM_LIMIT"]) == ("3000m", "30")
    assert (env["NVIDIA_VISIBLE_DEVICES"], env[CONFIG_ENV]) == ("void", CONFIG_DIR_IN_CONTAINER)


async def test_a_pod_given_two_of_three_gpus_by_cdi_sees_exactly_those_each_held_to_its_slice(
    runtime_stack: RuntimeStack,
) -> None:
    log, slot = await runtime_stack.run_workload("pair", gpu=2, gpumem=2000, gpucores=20)
    given = {d.uuid for d in slot}
    assert len(given) == 2

    # Its two GPUs, numbered in the host's order as a driver numbers the GPUs it can reach.
    sees_only(log, [g.uuid for g in GPUS if g.uuid in given], 2000)
