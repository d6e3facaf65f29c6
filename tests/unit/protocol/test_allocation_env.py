"""The Allocate response of one container (docs/wire-format.md#allocate-response)."""

from __future__ import annotations

from typing import Any

import pytest

from hamipy.protocol import allocation_env
from hamipy.protocol.allocation_env import (
    ContainerAllocation,
    Mount,
    allocation_mounts,
    container_allocation,
    limits_file_text,
    limits_host_path,
    memory_limit_bytes,
    region_host_dir,
    shared_cache_path,
)
from hamipy.protocol.allocation_env import (
    allocation_env as build_env,
)
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.errors import ProtocolError

GPU_A = "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448"
GPU_B = "GPU-00552014-5c87-89ac-b1a6-7b53aa24b0ec"
CACHE_ID = "8d3c6f2e-4b7a-4a57-9a43-0d1b8c2a3e11"
POD_UID = "5b9f3e0c-2d7a-4c1e-9f5e-7a6b8c9d0e1f"
ONE = [ContainerDevice(GPU_A, "NVIDIA", 3000, 0)]
TWO = [ContainerDevice(GPU_A, "NVIDIA", 2500, 25), ContainerDevice(GPU_B, "NVIDIA", 2500, 25)]
UNEVEN = [ContainerDevice(GPU_A, "NVIDIA", 1000, 30), ContainerDevice(GPU_B, "NVIDIA", 2000, 60)]

LIB = Mount("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so", read_only=True)
REGION = Mount("/usr/local/vgpu", f"/usr/local/vgpu/containers/{POD_UID}_cuda", read_only=False)
LIMITS_FILE = Mount(
    "/usr/local/vgpu/limits", f"/usr/local/vgpu/containers/{POD_UID}_cuda/limits", read_only=True
)
PRELOAD = Mount("/etc/ld.so.preload", "/usr/local/vgpu/ld.so.preload", read_only=True)


def test_one_device_env_exactly() -> None:
    assert build_env(ONE, cache_id=CACHE_ID) == {
        "NVIDIA_VISIBLE_DEVICES": GPU_A,
        "CUDA_DEVICE_MEMORY_LIMIT_0": "3000m",
        "CUDA_DEVICE_SM_LIMIT": "0",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/usr/local/vgpu/{CACHE_ID}.cache",
    }


def test_two_devices_env_exactly() -> None:
    assert build_env(TWO, cache_id=CACHE_ID) == {
        "NVIDIA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "2500m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "2500m",
        "CUDA_DEVICE_SM_LIMIT": "25",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/usr/local/vgpu/{CACHE_ID}.cache",
    }


def test_uneven_cores_also_get_per_device_limits() -> None:
    env = build_env(UNEVEN, cache_id=CACHE_ID)
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"  # upstream: the first device's cores
    assert env["CUDA_DEVICE_SM_LIMIT_0"] == "30"
    assert env["CUDA_DEVICE_SM_LIMIT_1"] == "60"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "2000m"


def test_even_cores_have_no_per_device_sm_limits() -> None:
    assert not any(key.startswith("CUDA_DEVICE_SM_LIMIT_") for key in build_env(TWO, cache_id=CACHE_ID))


@pytest.mark.parametrize(
    ("scaling", "oversubscribe"),
    [(1.0, False), (0.5, False), (1.5, True), (2, True)],
    ids=["1", "0.5", "1.5", "2"],
)
def test_oversubscribe_when_memory_scaling_above_1(scaling: float, oversubscribe: bool) -> None:
    env = build_env(ONE, cache_id=CACHE_ID, memory_scaling=scaling)
    assert ("CUDA_OVERSUBSCRIBE" in env) is oversubscribe
    if oversubscribe:
        assert env["CUDA_OVERSUBSCRIBE"] == "true"


@pytest.mark.parametrize(
    ("policy", "disable", "expected"),
    [
        ("default", False, None),
        ("force", False, "force"),
        ("disable", False, "disable"),
        ("default", True, "disable"),
        ("force", True, "disable"),
    ],
    ids=["default", "force", "disable", "disable-core-limit", "disable-core-limit-wins"],
)
def test_core_utilization_policy(policy: Any, disable: bool, expected: str | None) -> None:
    env = build_env(ONE, cache_id=CACHE_ID, core_policy=policy, disable_core_limit=disable)
    assert env.get("GPU_CORE_UTILIZATION_POLICY") == expected


@pytest.mark.parametrize(("level", "expected"), [(None, None), (0, "0"), (3, "3"), (4, "4")])
def test_log_level(level: int | None, expected: str | None) -> None:
    assert build_env(ONE, cache_id=CACHE_ID, log_level=level).get("LIBCUDA_LOG_LEVEL") == expected


def test_custom_hook_path_moves_the_cache_file() -> None:
    env = build_env(ONE, cache_id="abc", hook_path="/opt/hami/vgpu/")
    assert env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/opt/hami/vgpu/abc.cache"


BAD_DEVICES = [
    ("no-devices", [], "devices", "at least one device"),
    (
        "seventeen-devices",
        [ContainerDevice(f"GPU-{i}", "NVIDIA", 1, 0) for i in range(17)],
        "devices",
        "at most 16",
    ),
    ("zero-memory", [ContainerDevice(GPU_A, "NVIDIA", 0, 0)], "devices[0].usedmem", "no memory limit"),
    (
        "negative-memory",
        [*ONE, ContainerDevice(GPU_B, "NVIDIA", -1, 0)],
        "devices[1].usedmem",
        "must be positive",
    ),
    ("cores-above-100", [ContainerDevice(GPU_A, "NVIDIA", 10, 101)], "devices[0].usedcores", "0-100"),
    ("negative-cores", [ContainerDevice(GPU_A, "NVIDIA", 10, -1)], "devices[0].usedcores", "0-100"),
    ("empty-uuid", [ContainerDevice("", "NVIDIA", 10, 0)], "devices[0].uuid", "non-empty"),
    ("comma-in-uuid", [ContainerDevice("GPU-a,GPU-b", "NVIDIA", 10, 0)], "devices[0].uuid", "without ','"),
]


@pytest.mark.parametrize(
    ("devices", "field", "reason"), [c[1:] for c in BAD_DEVICES], ids=[c[0] for c in BAD_DEVICES]
)
def test_bad_devices_are_refused(devices: list[ContainerDevice], field: str, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason) as info:
        build_env(devices, cache_id=CACHE_ID)
    assert info.value.field == field


def test_smallest_memory_and_whole_gpu_cores_are_fine() -> None:
    env = build_env([ContainerDevice(GPU_A, "NVIDIA", 1, 100)], cache_id=CACHE_ID)
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "100"


def test_sixteen_devices_are_fine() -> None:
    devices = [ContainerDevice(f"GPU-{i}", "NVIDIA", 100, 10) for i in range(16)]
    env = build_env(devices, cache_id=CACHE_ID)
    assert env["CUDA_DEVICE_MEMORY_LIMIT_15"] == "100m"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"core_policy": "always"}, "gpuCorePolicy"),
        ({"log_level": 5}, "libCudaLogLevel"),
        ({"log_level": -1}, "libCudaLogLevel"),
        ({"cache_id": "../x"}, "cache id"),
        ({"cache_id": ""}, "cache id"),
        ({"hook_path": "relative/vgpu"}, "hookPath"),
        ({"hook_path": "/usr/../etc"}, "hookPath"),
    ],
    ids=[
        "policy",
        "log-level-5",
        "log-level-negative",
        "cache-id-traversal",
        "cache-id-empty",
        "relative-hook",
        "dotdot-hook",
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"cache_id": CACHE_ID, **kwargs}
    with pytest.raises(ProtocolError) as info:
        build_env(ONE, **args)
    assert info.value.field == field


# mounts ------------------------------------------------------------------------------------------


def test_mounts_put_the_limits_file_read_only_over_the_region_directory() -> None:
    assert allocation_mounts(pod_uid=POD_UID, container_name="cuda") == [LIB, REGION, LIMITS_FILE, PRELOAD]


def test_no_mount_is_shared_writable_across_containers() -> None:
    # Upstream's /tmp/vgpulock is one host directory every GPU container writes: not mounted here.
    mounts = allocation_mounts(pod_uid=POD_UID, container_name="cuda")
    writable = [m.host_path for m in mounts if not m.read_only]
    assert writable == [f"/usr/local/vgpu/containers/{POD_UID}_cuda"]


def test_custom_hook_path_mounts() -> None:
    got = allocation_mounts(hook_path="/opt/vgpu", pod_uid=POD_UID, container_name="train")
    assert got == [
        Mount("/opt/vgpu/libvgpu.so", "/opt/vgpu/libvgpu.so", read_only=True),
        Mount("/opt/vgpu", f"/opt/vgpu/containers/{POD_UID}_train", read_only=False),
        Mount("/opt/vgpu/limits", f"/opt/vgpu/containers/{POD_UID}_train/limits", read_only=True),
        Mount("/etc/ld.so.preload", "/opt/vgpu/ld.so.preload", read_only=True),
    ]


def test_limits_host_path_is_in_the_region_directory() -> None:
    assert (
        limits_host_path("/usr/local/vgpu", POD_UID, "cuda")
        == f"/usr/local/vgpu/containers/{POD_UID}_cuda/limits"
    )


def test_limits_file_holds_the_limits_without_devices_or_log_level() -> None:
    env = build_env(UNEVEN, cache_id=CACHE_ID, core_policy="force", log_level=3, task_priority=0)
    assert limits_file_text(env) == (
        "CUDA_DEVICE_MEMORY_LIMIT_0=1000m\n"
        "CUDA_DEVICE_MEMORY_LIMIT_1=2000m\n"
        "CUDA_DEVICE_SM_LIMIT=30\n"
        "CUDA_DEVICE_SM_LIMIT_0=30\n"
        "CUDA_DEVICE_SM_LIMIT_1=60\n"
        f"CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/{CACHE_ID}.cache\n"
        "GPU_CORE_UTILIZATION_POLICY=force\n"
        "CUDA_TASK_PRIORITY=0\n"
    )


def test_task_priority_travels_with_the_limits() -> None:
    assert build_env(ONE, cache_id=CACHE_ID, task_priority=1)["CUDA_TASK_PRIORITY"] == "1"
    assert "CUDA_TASK_PRIORITY" not in build_env(ONE, cache_id=CACHE_ID)


def test_region_host_dir() -> None:
    assert region_host_dir("/usr/local/vgpu", POD_UID, "cuda") == f"/usr/local/vgpu/containers/{POD_UID}_cuda"
    assert (
        region_host_dir("/usr/local/vgpu/", POD_UID, "cuda") == f"/usr/local/vgpu/containers/{POD_UID}_cuda"
    )


@pytest.mark.parametrize(
    ("pod_uid", "name", "field"),
    [
        ("../..", "cuda", "pod uid"),
        (POD_UID, "a/b", "container name"),
        (POD_UID, "..", "container name"),
        ("", "cuda", "pod uid"),
    ],
    ids=["uid-traversal", "name-slash", "name-dotdot", "uid-empty"],
)
def test_region_host_dir_refuses_path_tricks(pod_uid: str, name: str, field: str) -> None:
    with pytest.raises(ProtocolError, match="plain file name") as info:
        region_host_dir("/usr/local/vgpu", pod_uid, name)
    assert info.value.field == field


def test_shared_cache_path() -> None:
    assert shared_cache_path("/usr/local/vgpu", CACHE_ID) == f"/usr/local/vgpu/{CACHE_ID}.cache"


# together ----------------------------------------------------------------------------------------


def test_container_allocation_combines_env_mounts_and_limits_file() -> None:
    got = container_allocation(
        TWO,
        pod_uid=POD_UID,
        container_name="cuda",
        cache_id=CACHE_ID,
        memory_scaling=2.0,
        core_policy="force",
        log_level=1,
        task_priority=0,
    )
    envs = {
        "NVIDIA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "2500m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "2500m",
        "CUDA_DEVICE_SM_LIMIT": "25",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/usr/local/vgpu/{CACHE_ID}.cache",
        "CUDA_OVERSUBSCRIBE": "true",
        "GPU_CORE_UTILIZATION_POLICY": "force",
        "CUDA_TASK_PRIORITY": "0",
        "LIBCUDA_LOG_LEVEL": "1",
    }
    assert got == ContainerAllocation(
        envs=envs,
        mounts=(LIB, REGION, LIMITS_FILE, PRELOAD),
        limits_path=f"/usr/local/vgpu/containers/{POD_UID}_cuda/limits",
        limits_text=limits_file_text(envs),
    )


# docs/wire-format.md#interposer-environment: how the interposer reads the limits -----------------

LIMITS = [
    ("3000m", 3000 * 2**20),
    ("3000M", 3000 * 2**20),
    ("1g", 2**30),
    ("16G", 16 * 2**30),
    ("512k", 512 * 1024),
    ("1048576", 1048576),
    ("0", 0),
    ("0m", 0),
]


@pytest.mark.parametrize(("value", "expected"), LIMITS, ids=[v for v, _ in LIMITS])
def test_memory_limit_bytes(value: str, expected: int) -> None:
    assert memory_limit_bytes(value) == expected


@pytest.mark.parametrize("value", ["", "m", "1.5g", "-1m", "1t", "1mb", "12 m"], ids=repr)
def test_memory_limit_bytes_refuses(value: str) -> None:
    with pytest.raises(ProtocolError, match="digits with an optional k, m or g suffix") as info:
        memory_limit_bytes(value)
    assert info.value.field == "CUDA_DEVICE_MEMORY_LIMIT"


def test_memory_limit_bytes_refuses_64_bit_overflow() -> None:
    with pytest.raises(ProtocolError, match="64 bits"):
        memory_limit_bytes("99999999999999999999g")


def test_memory_limit_bytes_takes_up_to_two_to_the_64_minus_one() -> None:
    assert memory_limit_bytes(str(2**64 - 1)) == 2**64 - 1
    assert memory_limit_bytes("17179869183g") == (2**34 - 1) << 30
    with pytest.raises(ProtocolError, match="64 bits"):
        memory_limit_bytes(str(2**64))
    with pytest.raises(ProtocolError, match="64 bits"):
        memory_limit_bytes("17179869184g")


def test_env_limits_read_back_as_device_memory() -> None:
    env = build_env(UNEVEN, cache_id=CACHE_ID)
    assert [memory_limit_bytes(env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"]) for i in range(2)] == [
        1000 * 2**20,
        2000 * 2**20,
    ]


def test_public_api_is_complete() -> None:
    assert sorted(allocation_env.__all__) == sorted(
        [
            "CORE_POLICIES",
            "DEFAULT_HOOK_PATH",
            "ENV_CORE_POLICY",
            "ENV_DISABLE_CONTROL",
            "ENV_LOG_LEVEL",
            "ENV_MEMORY_LIMIT",
            "ENV_OVERSUBSCRIBE",
            "ENV_SHARED_CACHE",
            "ENV_SM_LIMIT",
            "ENV_TASK_PRIORITY",
            "ENV_VISIBLE_DEVICES",
            "LD_SO_PRELOAD",
            "LIMITS_FILE",
            "MAX_DEVICES",
            "ContainerAllocation",
            "CorePolicy",
            "Mount",
            "allocation_env",
            "allocation_mounts",
            "container_allocation",
            "limits_file_text",
            "limits_host_path",
            "memory_limit_bytes",
            "parse_region_dir_name",
            "region_dir_name",
            "region_host_dir",
            "shared_cache_path",
        ]
    )
    for name in allocation_env.__all__:
        assert hasattr(allocation_env, name)


def test_region_dir_name_round_trips() -> None:
    path = allocation_env.region_host_dir("/usr/local/vgpu", "0a1b2c3d-4e5f-4789-8abc-def012345678", "main")
    name = path.rsplit("/", 1)[1]
    assert allocation_env.parse_region_dir_name(name) == ("0a1b2c3d-4e5f-4789-8abc-def012345678", "main")


@pytest.mark.parametrize("name", ["nounderscore", "_main", "uid_", "uid_a/b", ".._x"])
def test_region_dir_names_it_would_not_make_are_refused(name: str) -> None:
    with pytest.raises(ProtocolError):
        allocation_env.parse_region_dir_name(name)
