"""The ``cdi-cri`` strategy on the real kubelet (docs/device-plugin.md#cdi): a GPU pod's container
is created with the CDI devices of its own slot and its GPU, and none of the slot's env or mounts;
the slot's spec file on the node holds its own limits; the monitor removes the spec once the pod is
gone.

The node is ``stack_support.gpu_node`` with the plugin set to ``cdi-cri`` (its spec directory of
its own) and the monitor beside it, removing what is left of a pod at once (``--gone-grace 0``).
The fake runtime records the CDI device names the kubelet passes in the CRI's ``cdi_devices``; what
a runtime's CDI library makes of the spec is ``hamipy.protocol.cdi``'s unit tests'.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from builders import container
from stack_support import NEEDS_REAL_KUBELET, GpuStack, allocated_slots

from hamipy.devcluster import API_TIMEOUT_S, wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.protocol.allocation_env import LD_SO_PRELOAD, allocation_env, limits_file_text
from hamipy.protocol.cdi import CdiSpec, decode_spec

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPUS = (
    FakeGpu("GPU-cdcdcdcd-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-80GB", 81920, numa=0),
    FakeGpu("GPU-cdcdcdcd-0000-4000-8000-000000000001", "NVIDIA A100-SXM4-80GB", 81920, numa=1),
)
NVIDIA = {"deviceListStrategy": "cdi-cri"}
MONITOR_ARGS = ("--feedback-interval", "0.3", "--gone-grace", "0")


def spec_path(stack: GpuStack, uid: str, container_name: str) -> Path:
    return stack.plugin.cdi_spec_dir / f"hami.io-vgpu_{uid}_{container_name}.json"


def read_spec(path: Path) -> CdiSpec:
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    return decode_spec(path.read_bytes())


async def served_with_spec(stack: GpuStack, name: str, gpumem: int) -> tuple[dict[str, Any], CdiSpec]:
    """Create pod ``name`` (container ``main``: one GPU, ``gpumem`` MiB, 30 % of its cores); the
    pod once served, and its slot's spec. The container's record shows the CDI devices and none of
    the slot's env or mounts."""
    await stack.create(stack.pod_body(name, [container("main", gpu=1, gpumem=gpumem, gpucores=30)]))
    pod = await stack.served(name)
    uid = pod["metadata"]["uid"]
    ((device,),) = allocated_slots(pod)
    config = await stack.container(name, "main")
    assert config.cdi_devices == (f"hami.io/vgpu={uid}_main", f"nvidia.com/gpu={device.uuid}")
    hook = str(stack.plugin.hook_path)
    assert [k for k in config.envs if k.startswith(("CUDA_", "NVIDIA_", "GPU_"))] == []
    paths = [path for m in config.mounts for path in (m.container_path, m.host_path)]
    assert [path for path in paths if path.startswith(hook)] == []
    assert [m for m in config.mounts if m.container_path == LD_SO_PRELOAD] == []
    return pod, read_spec(spec_path(stack, uid, "main"))


async def test_a_container_gets_its_slot_and_its_gpu_as_cdi_devices(gpu_stack: GpuStack) -> None:
    pod, spec = await served_with_spec(gpu_stack, "cdi", 3000)
    uid = pod["metadata"]["uid"]
    (slot,) = allocated_slots(pod)
    assert [(d.usedmem, d.usedcores) for d in slot] == [(3000, 30)]
    (device,) = spec.devices
    assert (spec.cdi_version, spec.kind, device.name) == ("0.5.0", "hami.io/vgpu", f"{uid}_main")
    # The spec holds what the envvar strategy would have answered for this slot.
    env = dict(e.split("=", 1) for e in device.container_edits.env)
    hook = gpu_stack.plugin.hook_path
    cache = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    assert env == allocation_env(slot, cache_id=cache.stem, hook_path=str(hook))
    mounts = {m.container_path: (m.host_path, m.options[-1]) for m in device.container_edits.mounts}
    region = hook / "containers" / f"{uid}_main"
    assert mounts == {
        f"{hook}/libvgpu.so": (f"{hook}/libvgpu.so", "ro"),
        str(hook): (str(region), "rw"),
        f"{hook}/limits": (f"{region}/limits", "ro"),
        LD_SO_PRELOAD: (f"{hook}/ld.so.preload", "ro"),
    }
    # The limits the interposer reads, written on the node beside the spec.
    assert (region / "limits").read_text() == limits_file_text(env)
    await gpu_stack.running("cdi")


async def test_each_pod_has_its_own_spec_and_a_deleted_pods_spec_is_removed(gpu_stack: GpuStack) -> None:
    pods = {}
    for name, gpumem in (("small", 1000), ("large", 2000)):
        pod, spec = await served_with_spec(gpu_stack, name, gpumem)
        env = dict(e.split("=", 1) for e in spec.devices[0].container_edits.env)
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{gpumem}m", "its own limits"
        pods[name] = pod["metadata"]["uid"]
    small, large = (spec_path(gpu_stack, uid, "main") for uid in pods.values())
    await gpu_stack.core.delete_namespaced_pod(
        "small", gpu_stack.namespace, grace_period_seconds=0, _request_timeout=API_TIMEOUT_S
    )
    await wait_for(lambda: not small.exists(), timeout=60, interval=0.2, what="the spec of the pod removed")
    assert not (gpu_stack.plugin.hook_path / "containers" / f"{pods['small']}_main").exists()
    assert read_spec(large).devices[0].name == f"{pods['large']}_main", "the other pod keeps its spec"
