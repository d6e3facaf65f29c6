"""The fake driver's MIG, seen through pynvml and the fake libcuda: MIG mode, each model's
GPU-instance profiles and placements, GPU and compute instances made and destroyed with real
NVML's return codes, MIG device handles and UUIDs, the instances shared by every process, and a
container given a MIG device (a `gpu uuid=MIG-...` line or CUDA_VISIBLE_DEVICES=MIG-...) held
to the instance's memory, with the interposer over it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from native_support import (
    GPU0_UUID,
    GPU1_UUID,
    Container,
    ContainerFactory,
    MiB,
    expect_ok,
    run_python,
    stop,
    wait_for_line,
)

from hamipy.protocol.region import parse_region

pytestmark = pytest.mark.native

A100_40 = f'gpu uuid={GPU0_UUID} name="NVIDIA A100-SXM4-40GB" memory=40g'
L40S = f'gpu uuid={GPU1_UUID} name="NVIDIA L40S" memory=48g'

# Runs after `import pynvml as n`, `n.nvmlInit()`, h = GPU 0's handle; prints one JSON value.
PRELUDE = """
import json, pynvml as n
from ctypes import byref
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0) if n.nvmlDeviceGetCount() else None
def code(call, *args):
    try:
        call(*args)
        return "ok"
    except n.NVMLError as e:
        return e.value
def place(start, size):
    return byref(n.c_nvmlGpuInstancePlacement_t(start, size))
def mig_devices(parent):
    out = []
    for k in range(n.nvmlDeviceGetMaxMigDeviceCount(parent)):
        try:
            m = n.nvmlDeviceGetMigDeviceHandleByIndex(parent, k)
        except n.NVMLError_NotFound:
            continue
        out.append([n.nvmlDeviceGetUUID(m), n.nvmlDeviceGetGpuInstanceId(m),
                    n.nvmlDeviceGetComputeInstanceId(m), n.nvmlDeviceGetName(m),
                    n.nvmlDeviceGetMemoryInfo(m).total // 2**20])
    return out
"""

NVML_SUCCESS = "ok"
NOT_SUPPORTED = 3
INVALID_ARGUMENT = 2
NOT_FOUND = 6
IN_USE = 19
INSUFFICIENT_RESOURCES = 23


def nvml(container: Container, body: str) -> Any:
    """Runs pynvml code (PRELUDE first) in a process of the container; its printed JSON value."""
    return json.loads(expect_ok(run_python(container, PRELUDE + body)).splitlines()[-1])


def mig_container(make_container: ContainerFactory, gpus: str, **kwargs: object) -> Container:
    return make_container(preload=False, gpus=gpus, **kwargs)


def inside(
    make_container: ContainerFactory, host: Container, lines: str, *, preload: bool = False, **kwargs: object
) -> Container:
    """A container of the host: its configuration lists only `lines`, over the host's state."""
    state = f"state = {host.env['HAMIPY_FAKE_GPU_CONFIG']}.state\n"
    return make_container(preload=preload, gpus=state + lines, **kwargs)


def test_mig_mode_applies_at_once_on_an_idle_gpu_and_is_pending_while_used(
    make_container: ContainerFactory,
) -> None:
    host = mig_container(make_container, f"{A100_40}\n{L40S}\n")
    body = """
l40s = n.nvmlDeviceGetHandleByIndex(1)
out = [n.nvmlDeviceGetMigMode(h), n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_ENABLE),
       n.nvmlDeviceGetMigMode(h),
       code(n.nvmlDeviceGetMigMode, l40s), code(n.nvmlDeviceSetMigMode, l40s, 1),
       code(n.nvmlDeviceGetGpuInstanceProfileInfo, l40s, 0), n.nvmlDeviceGetMaxMigDeviceCount(l40s),
       code(n.nvmlDeviceSetMigMode, h, 7)]
print(json.dumps(out))
"""
    assert nvml(host, body) == [
        [0, 0],
        0,
        [1, 1],
        NOT_SUPPORTED,
        NOT_SUPPORTED,
        NOT_SUPPORTED,
        0,
        INVALID_ARGUMENT,
    ]
    # A process on the GPU: the new mode stays pending (activation IN_USE) until the GPU is idle.
    holder = host.popen("region_peer", "hold", "40")
    try:
        wait_for_line(holder, "held")
        disable = "print(json.dumps([n.nvmlDeviceSetMigMode(h, 0), n.nvmlDeviceGetMigMode(h)]))"
        assert nvml(host, disable) == [IN_USE, [1, 0]]
    finally:
        stop(holder)
    assert nvml(host, disable) == [0, [0, 0]]


PROFILES = """
out = []
for index in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
    try:
        i = n.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
    except n.NVMLError_NotSupported:
        continue
    count = n.c_uint(0)
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, i.id, None, byref(count))
    placements = (n.c_nvmlGpuInstancePlacement_t * count.value)()
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, i.id, placements, byref(count))
    v1 = n.nvmlDeviceGetGpuInstanceProfileInfo(h, index, version=1)
    assert (v1.id, v1.memorySizeMB, v1.multiprocessorCount) == (i.id, i.memorySizeMB, i.multiprocessorCount)
    name = i.name.decode() if isinstance(i.name, bytes) else i.name
    out.append([index, i.id, name, i.sliceCount, i.instanceCount, i.memorySizeMB, i.multiprocessorCount,
                [[p.start, p.size] for p in placements]])
print(json.dumps(out))
"""

ONE_G = [[s, 1] for s in range(7)]
DOUBLE_ONE_G = [[0, 2], [2, 2], [4, 2], [6, 2]]
TWO_G = [[0, 2], [2, 2], [4, 2]]
THREE_G = [[0, 4], [4, 4]]


def table(names: list[str], memory: list[int], sms: list[int]) -> list[list[object]]:
    """Rows in profile-index order: 1g, 2g, 3g, 4g, 7g, 1g+me, 1g double memory."""
    shapes = [
        (0, 19, 1, 7, ONE_G),
        (1, 14, 2, 3, TWO_G),
        (2, 9, 3, 2, THREE_G),
        (3, 5, 4, 1, [[0, 4]]),
        (4, 0, 7, 1, [[0, 8]]),
        (7, 20, 1, 1, ONE_G),
        (9, 15, 1, 4, DOUBLE_ONE_G),
    ]
    return [
        [index, pid, f"MIG {name}", slices, count, mem, sm, placements]
        for (index, pid, slices, count, placements), name, mem, sm in zip(
            shapes, names, memory, sms, strict=True
        )
    ]


@pytest.mark.parametrize(
    ("name", "memory", "expected"),
    [
        (
            "NVIDIA A100-SXM4-40GB",
            "40g",
            table(
                ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb", "1g.5gb+me", "1g.10gb"],
                [4864, 9856, 19968, 19968, 40192, 4864, 9856],
                [14, 28, 42, 56, 98, 14, 14],
            ),
        ),
        (
            "NVIDIA A100-SXM4-80GB",
            "80g",
            table(
                ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.10gb+me", "1g.20gb"],
                [9856, 19968, 40192, 40192, 80384, 9856, 19968],
                [14, 28, 42, 56, 98, 14, 14],
            ),
        ),
        (
            "NVIDIA H100 80GB HBM3",
            "80g",
            table(
                ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.10gb+me", "1g.20gb"],
                [10240, 20480, 40960, 40960, 81920, 10240, 20480],
                [16, 32, 48, 64, 112, 16, 16],
            ),
        ),
        (
            "NVIDIA H200",
            "141g",
            table(
                ["1g.18gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb", "1g.18gb+me", "1g.35gb"],
                [18432, 35840, 72704, 72704, 144384, 18432, 35840],
                [16, 32, 48, 64, 112, 16, 16],
            ),
        ),
    ],
)
def test_each_model_reports_its_profile_table(
    make_container: ContainerFactory, name: str, memory: str, expected: list[list[object]]
) -> None:
    host = mig_container(make_container, f'gpu uuid={GPU0_UUID} name="{name}" memory={memory}\n')
    assert nvml(host, PROFILES) == expected


LIFECYCLE = """
p2 = n.nvmlDeviceGetGpuInstanceProfileInfo(h, n.NVML_GPU_INSTANCE_PROFILE_2_SLICE).id
p3 = n.nvmlDeviceGetGpuInstanceProfileInfo(h, n.NVML_GPU_INSTANCE_PROFILE_3_SLICE).id
p7 = n.nvmlDeviceGetGpuInstanceProfileInfo(h, n.NVML_GPU_INSTANCE_PROFILE_7_SLICE).id
out = {"off": code(n.nvmlDeviceCreateGpuInstance, h, p3)}
n.nvmlDeviceSetMigMode(h, 1)
gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, p3, place(4, 4))
out["overlap"] = code(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, p2, place(4, 2))
out["not_a_placement"] = code(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, p2, place(1, 2))
out["whole_gpu"] = code(n.nvmlDeviceCreateGpuInstance, h, p7)
out["capacity"] = [n.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p) for p in (p2, p3, p7)]
info = n.nvmlGpuInstanceGetInfo(gi)
out["gi"] = [info.id, info.profileId, info.placement.start, info.placement.size]
cp = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, n.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
                                                    n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
ci = n.nvmlGpuInstanceCreateComputeInstance(gi, cp.id)
out["ci_full"] = n.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, cp.id)
out["gi_with_ci"] = code(n.nvmlGpuInstanceDestroy, gi)
out["mig"] = mig_devices(h)
first = out["mig"][0][0]
m = n.nvmlDeviceGetHandleByUUID(first)
parent = n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
out["by_uuid"] = [n.nvmlDeviceGetUUID(m), n.nvmlDeviceGetUUID(parent),
                  n.nvmlDeviceIsMigDeviceHandle(m).value, n.nvmlDeviceIsMigDeviceHandle(h).value,
                  code(n.nvmlDeviceGetGpuInstanceId, h), n.nvmlDeviceGetAttributes(m).multiprocessorCount,
                  n.nvmlDeviceGetAttributes(m).memorySizeMB]
out["disable_with_instances"] = code(n.nvmlDeviceSetMigMode, h, 0)
n.nvmlComputeInstanceDestroy(ci)
out["stale_ci"] = code(n.nvmlComputeInstanceDestroy, ci)
n.nvmlGpuInstanceDestroy(gi)
out["stale_gi"] = code(n.nvmlGpuInstanceGetInfo, gi)
out["gone"] = [code(n.nvmlDeviceGetHandleByUUID, first), code(n.nvmlDeviceGetGpuInstanceById, h, info.id)]
gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, p3, place(4, 4))
n.nvmlGpuInstanceCreateComputeInstance(gi, cp.id)
out["again"] = mig_devices(h)
print(json.dumps(out))
"""


def test_instances_are_made_and_destroyed_with_real_nvmls_codes(make_container: ContainerFactory) -> None:
    host = mig_container(make_container, f"{A100_40}\n")
    out = nvml(host, LIFECYCLE)
    assert out["off"] == NOT_SUPPORTED
    assert (out["overlap"], out["not_a_placement"], out["whole_gpu"]) == (
        INSUFFICIENT_RESOURCES,
        INVALID_ARGUMENT,
        INSUFFICIENT_RESOURCES,
    )
    assert out["capacity"] == [2, 1, 0]
    assert out["gi"] == [1, 9, 4, 4]
    assert (out["ci_full"], out["gi_with_ci"], out["disable_with_instances"]) == (0, IN_USE, IN_USE)
    ((uuid, gi_id, ci_id, name, memory),) = out["mig"]
    assert uuid.startswith("MIG-")
    assert len(uuid) == len(GPU0_UUID)
    assert (gi_id, ci_id, name, memory) == (1, 0, "NVIDIA A100-SXM4-40GB MIG 3g.20gb", 19968)
    assert out["by_uuid"] == [uuid, GPU0_UUID, 1, 0, NOT_SUPPORTED, 42, 19968]
    assert (out["stale_ci"], out["stale_gi"]) == (INVALID_ARGUMENT, INVALID_ARGUMENT)
    assert out["gone"] == [NOT_FOUND, NOT_FOUND]
    # Re-made at the same placement: the same ids, a new UUID.
    ((again, gi_again, ci_again, _, _),) = out["again"]
    assert (gi_again, ci_again) == (1, 0)
    assert again != uuid


def test_configured_instances_are_seen_by_every_process(make_container: ContainerFactory) -> None:
    gpus = f"{A100_40} mig=on mig_instances=1g.5gb@6,2g.10gb@0\n"
    host = mig_container(make_container, gpus)
    listed = nvml(host, "print(json.dumps(mig_devices(h)))")
    assert [row[1:] for row in listed] == [
        [1, 0, "NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864],
        [2, 0, "NVIDIA A100-SXM4-40GB MIG 2g.10gb", 9856],
    ]
    # A 3g at 0 overlaps the 2g at 0; at 4 the 1g at 6 is in the way.
    blocked = "print(json.dumps([code(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 9, place(s, 4))\n"
    blocked += "                 for s in (0, 4)]))"
    assert nvml(host, blocked) == [INSUFFICIENT_RESOURCES, INSUFFICIENT_RESOURCES]
    destroy = """
gi = n.nvmlDeviceGetGpuInstanceById(h, 1)
n.nvmlComputeInstanceDestroy(n.nvmlGpuInstanceGetComputeInstanceById(gi, 0))
n.nvmlGpuInstanceDestroy(gi)
gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, place(4, 4))
n.nvmlGpuInstanceCreateComputeInstance(gi, 2)
print(json.dumps(mig_devices(h)))
"""
    made = nvml(host, destroy)
    # Another process sees what this one made, with the UUIDs it made.
    assert nvml(host, "print(json.dumps(mig_devices(h)))") == made
    assert [row[1:4] for row in made] == [
        [1, 0, "NVIDIA A100-SXM4-40GB MIG 3g.20gb"],
        [2, 0, "NVIDIA A100-SXM4-40GB MIG 2g.10gb"],
    ]


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        (f"{A100_40} mig=on mig_instances=3g.20gb@0,2g.10gb@2", "overlaps another instance"),
        (f"{A100_40} mig=on mig_instances=2g.10gb@1", "is not one of its placements"),
        (f"{A100_40} mig=on mig_instances=2g.20gb@0", "2g.20gb is not a A100 40GB profile"),
        (f"{A100_40} mig_instances=1g.5gb@0", "mig_instances needs mig=on"),
        (f"{L40S} mig=on", "MIG is not supported on NVIDIA L40S"),
        (f"{A100_40} mig=yes", "bad mig (on|off)"),
    ],
)
def test_bad_mig_keys_are_reported(make_container: ContainerFactory, gpus: str, message: str) -> None:
    container = mig_container(make_container, gpus + "\n")
    proc = run_python(container, "import pynvml; pynvml.nvmlInit()")
    assert proc.returncode != 0
    assert "gpus.conf:1: " in proc.stderr
    assert message in proc.stderr


def uuid_of_first_instance(host: Container) -> str:
    listed = nvml(host, "print(json.dumps(mig_devices(h)))")
    assert isinstance(listed, list)
    return str(listed[0][0])


def test_a_container_given_a_mig_uuid_is_held_to_the_instance(make_container: ContainerFactory) -> None:
    """`gpu uuid=MIG-...` resolves through the host's state: the device has the instance's memory
    (an allocation past it fails though the parent has room), and the host's NVML sees the use on
    that MIG device, with the process, and not on the other instance."""
    host = mig_container(make_container, f"{A100_40} mig=on mig_instances=1g.5gb@0,1g.5gb@1\n")
    uuid = uuid_of_first_instance(host)
    container = inside(make_container, host, f"gpu uuid={uuid}\n")
    seen = nvml(
        container,
        "print(json.dumps([n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetName(h),\n"
        "                  n.nvmlDeviceGetMemoryInfo(h).total]))",
    )
    assert seen == [uuid, "NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864 * MiB]
    refused = container.run("mig_device_memory", "4865")
    assert refused.returncode == 2, refused.stderr
    assert "total=4864 free=4864 rc=2" in refused.stdout
    holder = container.popen("region_peer", "hold", "4000")
    try:
        wait_for_line(holder, "held")
        usage = """
mig = [n.nvmlDeviceGetMigDeviceHandleByIndex(h, k) for k in (0, 1)]
busy = n.nvmlGpuInstanceGetComputeInstanceById(n.nvmlDeviceGetGpuInstanceById(h, 1), 0)
print(json.dumps([[n.nvmlDeviceGetMemoryInfo(m).used // 2**20,
                   [[p.usedGpuMemory // 2**20, p.gpuInstanceId, p.computeInstanceId]
                    for p in n.nvmlDeviceGetComputeRunningProcesses(m)]] for m in mig]
                 + [n.nvmlDeviceGetMemoryInfo(h).used // 2**20,
                    code(n.nvmlComputeInstanceDestroy, busy)]))
"""
        assert nvml(host, usage) == [[4000, [[4000, 1, 0]]], [0, []], 4000, IN_USE]
        # The instance's processes share its memory; the other instance has all of its own.
        more = container.run("mig_device_memory", "865")
        assert (more.returncode, more.stdout.split()[1:]) == (2, ["total=4864", "free=864", "rc=2"])
        listed = nvml(host, "print(json.dumps(mig_devices(h)))")
        assert isinstance(listed, list)
        neighbour = inside(make_container, host, f"gpu uuid={listed[1][0]}\n")
        whole = neighbour.run("mig_device_memory", "4864")
        assert whole.stdout.split()[1:] == ["total=4864", "free=0", "rc=0"], whole.stderr
    finally:
        stop(holder)


def test_a_mig_uuid_that_names_no_instance_is_absent(make_container: ContainerFactory) -> None:
    host = mig_container(make_container, f"{A100_40} mig=on\n")
    container = inside(make_container, host, "gpu uuid=MIG-00000000-0000-4000-8000-000000000000\n")
    assert nvml(container, "print(json.dumps(n.nvmlDeviceGetCount()))") == 0


def test_cuda_visible_devices_names_a_mig_device_under_the_host_configuration(
    make_container: ContainerFactory,
) -> None:
    host = mig_container(make_container, f"{L40S}\n{A100_40} mig=on mig_instances=2g.10gb@0\n")
    listed = nvml(host, "print(json.dumps(mig_devices(n.nvmlDeviceGetHandleByIndex(1))))")
    assert isinstance(listed, list)
    uuid = str(listed[0][0])
    refused = host.run("mig_device_memory", "9857", extra_env={"CUDA_VISIBLE_DEVICES": uuid})
    assert refused.returncode == 2, refused.stderr
    fits = host.run("mig_device_memory", "9856", extra_env={"CUDA_VISIBLE_DEVICES": uuid})
    assert fits.stdout.split() == [f"uuid={uuid[4:12]}", "total=9856", "free=0", "rc=0"]
    assert host.run("mig_device_memory", "9857").returncode == 0  # the L40S: device 0 without it


def test_the_interposer_keys_a_mig_device_by_its_mig_uuid(make_container: ContainerFactory) -> None:
    """Under libvgpu.so the container's device is its MIG device: the region names it by its MIG
    UUID, CUDA's device is matched to it (no fallback warning) and the limit holds."""
    host = mig_container(make_container, f"{A100_40} mig=on mig_instances=3g.20gb@0\n")
    uuid = uuid_of_first_instance(host)
    container = inside(
        make_container,
        host,
        f"gpu uuid={uuid}\n",
        preload=True,
        limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m"},
    )
    fits = container.run("region_peer", "alloc", "1000")
    assert fits.returncode == 0, fits.stderr
    assert "not in the region" not in fits.stderr
    assert container.run("region_peer", "alloc", "1025").returncode == 2
    snapshot = parse_region(Path(container.region_path).read_bytes())
    assert snapshot.uuids == (uuid,)
