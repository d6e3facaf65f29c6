"""What Allocate gives the container beyond its env: the limits file, written on the host before the
answer and mounted read-only (the interposer's source of limits, which the container's own env
cannot override), ``CUDA_TASK_PRIORITY`` from the container's ``nvidia.com/priority``, and the
preload mount a container cannot opt out of (docs/wire-format.md#allocate-response)."""

from __future__ import annotations

import stat
from pathlib import Path

import builders
import pytest
from allocator_support import (
    UUID_B,
    allocate_request,
    dev,
    legit_pod,
    make_allocator,
    plugin_stub,
    recording_pod_patches,
    waiting_pod,
)
from plugin_fakes import node_kube

from hamipy.protocol import keys
from hamipy.protocol.allocation_env import Mount
from hamipy.protocol.pod_devices import encode_pod_devices


def limits_of(tmp_path: Path, container: str = "main", pod: str = "legit") -> Path:
    return tmp_path / "vgpu" / "containers" / f"uid-ns-{pod}_{container}" / "limits"


async def test_the_limits_file_is_written_before_the_answer_read_only_and_mounted_read_only(
    tmp_path: Path,
) -> None:
    path = limits_of(tmp_path)
    api = node_kube(legit_pod())
    written_first = recording_pod_patches(api, path)
    allocator = await make_allocator(api, tmp_path)
    (allocation,) = await allocator.allocate([[f"{UUID_B}-0"]])
    hook = f"{tmp_path}/vgpu"
    assert path.read_text() == (
        "CUDA_DEVICE_MEMORY_LIMIT_0=30000m\n"
        "CUDA_DEVICE_SM_LIMIT=40\n"
        f"CUDA_DEVICE_MEMORY_SHARED_CACHE={hook}/c0ffee.cache\n"
    )
    assert written_first == [True], "written before the pod is marked served"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert allocation.limits_path == str(path)
    assert Mount(container_path=f"{hook}/limits", host_path=str(path), read_only=True) in allocation.mounts
    assert sorted(p.name for p in path.parent.iterdir()) == ["limits"], "nothing staged is left"


async def test_the_kubelet_is_answered_with_the_limits_file_mounted_read_only(tmp_path: Path) -> None:
    allocator = await make_allocator(node_kube(legit_pod()), tmp_path)
    async with plugin_stub(allocator) as stub:
        response = await stub.Allocate(allocate_request(f"{UUID_B}-0"), timeout=10)
    (answer,) = response.container_responses
    mounts = {m.container_path: (m.host_path, m.read_only) for m in answer.mounts}
    assert mounts[f"{tmp_path}/vgpu/limits"] == (str(limits_of(tmp_path)), True)
    assert limits_of(tmp_path).is_file()


async def test_a_second_allocate_of_a_container_replaces_its_limits_file_by_a_new_inode(
    tmp_path: Path,
) -> None:
    api = node_kube(legit_pod())
    await (await make_allocator(api, tmp_path)).allocate([[f"{UUID_B}-0"]])
    path = limits_of(tmp_path)
    first = path.stat().st_ino
    with path.open() as running:  # what a container started with the first answer has mounted
        # The pod is allocated again (after a plugin restart) with other limits.
        slots = encode_pod_devices([[dev(UUID_B, mem=20000, cores=40)]])
        api.pod("ns", "legit")["metadata"]["annotations"].update(
            {keys.BIND_PHASE: "allocating", keys.DEVICES_ALLOCATED: slots, keys.DEVICES_TO_ALLOCATE: slots}
        )
        api.pod("ns", "legit")["spec"]["containers"][0]["resources"]["limits"][keys.RESOURCE_MEMORY] = "20000"
        (allocation,) = await (await make_allocator(api, tmp_path)).allocate([[f"{UUID_B}-1"]])
        assert allocation.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20000m"
        assert path.stat().st_ino != first
        assert "CUDA_DEVICE_MEMORY_LIMIT_0=20000m\n" in path.read_text()
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
        assert "CUDA_DEVICE_MEMORY_LIMIT_0=30000m\n" in running.read(), "the running container's file is kept"
    assert sorted(p.name for p in path.parent.iterdir()) == ["limits"]


@pytest.mark.parametrize("priority", [0, 1, None], ids=["high", "low", "none"])
async def test_the_task_priority_comes_from_the_containers_priority(
    tmp_path: Path, priority: int | None
) -> None:
    api = node_kube(
        waiting_pod(
            "p",
            builders.container("main", gpu=1, gpumem=1000, gpucores=10, priority=priority),
            slots=[[dev(UUID_B)]],
        )
    )
    (allocation,) = await (await make_allocator(api, tmp_path)).allocate([[f"{UUID_B}-0"]])
    lines = limits_of(tmp_path, pod="p").read_text().splitlines()
    if priority is None:
        assert "CUDA_TASK_PRIORITY" not in allocation.envs
        assert not [line for line in lines if line.startswith("CUDA_TASK_PRIORITY=")]
    else:
        assert allocation.envs["CUDA_TASK_PRIORITY"] == str(priority)
        assert f"CUDA_TASK_PRIORITY={priority}" in lines


async def test_a_container_that_disables_control_in_its_env_still_gets_the_interposer(
    tmp_path: Path,
) -> None:
    api = node_kube(
        waiting_pod(
            "p",
            builders.container("main", gpu=1, gpumem=1000, gpucores=10, env={"CUDA_DISABLE_CONTROL": "true"}),
            slots=[[dev(UUID_B)]],
        )
    )
    (allocation,) = await (await make_allocator(api, tmp_path)).allocate([[f"{UUID_B}-0"]])
    mounts = {m.container_path: m for m in allocation.mounts}
    assert mounts["/etc/ld.so.preload"] == Mount(
        container_path="/etc/ld.so.preload", host_path=f"{tmp_path}/vgpu/ld.so.preload", read_only=True
    )
    assert "/tmp/vgpulock" not in mounts, "no host directory shared writable across containers"
    assert [m.container_path for m in allocation.mounts if not m.read_only] == [f"{tmp_path}/vgpu"]
    assert "CUDA_DISABLE_CONTROL" not in allocation.envs
    assert "CUDA_DISABLE_CONTROL" not in limits_of(tmp_path, pod="p").read_text()
