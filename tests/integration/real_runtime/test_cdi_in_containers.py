"""GPU pods whose devices come by CDI, in real containers: with the device plugin's ``cdi-cri``
strategy (docs/device-plugin.md#cdi) the kubelet hands containerd only the CDI names of the slot
and its GPUs; containerd resolves them from the plugin's spec directory (the slot: env, limits
file, interposer) and the toolkit stand-in's (the GPUs: the fake driver, each GPU as the container
sees it), and the process is held to its slice on exactly its own GPUs.
"""

from __future__ import annotations

import pytest
from runtime_support import NEEDS_REAL_KUBELET, RuntimeStack, held_to, workload
from stack_support import allocated_slots

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
    stack = runtime_stack.stack
    await stack.create(stack.pod_body("one", [workload(gpu=1, gpumem=3000, gpucores=30)]))
    log = await runtime_stack.ready("one")
    ((slot,),) = allocated_slots(await stack.pod("one"))

    # One GPU, its own, at its own size, refused past it.
    assert log.one("driver")["devices"] == 1
    device = log.one("device", index=0)
    assert device["uuid"] == slot.uuid
    held_to(device, log.one("alloc", index=0), 3000)
    # The slot's spec put the limits and the interposer in; the toolkit's came after it.
    env = await runtime_stack.env("one")
    assert (env["CUDA_DEVICE_MEMORY_LIMIT_0"], env["CUDA_DEVICE_SM_LIMIT"]) == ("3000m", "30")
    assert (env["NVIDIA_VISIBLE_DEVICES"], env[CONFIG_ENV]) == ("void", CONFIG_DIR_IN_CONTAINER)
    hook = stack.plugin.hook_path
    assert f"{hook}/libvgpu.so" in await runtime_stack.exec("one", "cat", "/proc/1/maps")
    assert (await runtime_stack.exec("one", "cat", "/etc/ld.so.preload")).strip() == f"{hook}/libvgpu.so"


async def test_a_pod_given_two_of_three_gpus_by_cdi_sees_exactly_those_each_held_to_its_slice(
    runtime_stack: RuntimeStack,
) -> None:
    stack = runtime_stack.stack
    await stack.create(stack.pod_body("pair", [workload(gpu=2, gpumem=2000, gpucores=20)]))
    log = await runtime_stack.ready("pair")
    (slot,) = allocated_slots(await stack.pod("pair"))
    given = {d.uuid for d in slot}
    assert len(given) == 2

    # Its two GPUs, numbered in the host's order as a driver numbers the GPUs it can reach.
    assert log.one("driver")["devices"] == 2
    seen = [log.one("device", index=i)["uuid"] for i in range(2)]
    assert seen == [g.uuid for g in GPUS if g.uuid in given]
    for i in range(2):
        held_to(log.one("device", index=i), log.one("alloc", index=i), 2000)
