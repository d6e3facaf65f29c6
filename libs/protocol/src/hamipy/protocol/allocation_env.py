"""The Allocate response for one container: env, mounts and the limits file
(docs/wire-format.md#allocate-response).

This is what makes a shared GPU a slice: the env carries the limits in HAMi's names, the mounts put
the interposer into every process of the container, give it a per-container directory for its
shared region file, and put the container's limits where its processes cannot write them: the
limits file, written by the device plugin into that directory on the host and mounted read-only
over ``<hook>/limits``. The interposer takes its limits from that file, never from the environment,
which the container's own ``env`` overrides (the kubelet passes the plugin's env first and the
container's after it). Pure: the caller makes the cache id (``uuid.uuid4()``), creates the host
directory and writes the file.

Facts taken from HAMi's device plugin (``pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go``,
``Allocate``), where ``HOOK_PATH`` is ``/usr/local`` and ``/vgpu`` is appended; our ``hook_path`` is
that whole directory, ``/usr/local/vgpu``:

- ``NVIDIA_VISIBLE_DEVICES``: the container's GPU UUIDs joined with ``,``.
- ``CUDA_DEVICE_MEMORY_LIMIT_<i>``: ``<MiB>m`` for the container's i-th device.
- ``CUDA_DEVICE_SM_LIMIT``: the cores of the container's *first* device. The scheduler gives every
  device of a container the same cores, so upstream sets one value; should they ever differ, we also
  set ``CUDA_DEVICE_SM_LIMIT_<i>`` per device, which the interposer prefers
  (docs/wire-format.md#interposer-environment).
- ``CUDA_DEVICE_MEMORY_SHARED_CACHE``: ``<hook>/<uuid4>.cache``, a path inside the container, in the
  per-container directory mounted at ``<hook>``.
- ``CUDA_OVERSUBSCRIBE=true`` when memory scaling > 1.
- ``GPU_CORE_UTILIZATION_POLICY``: ``disable`` when the node disables the core limit (upstream's
  Allocate); else the configured policy when it is not ``default`` (upstream's webhook puts it in the
  container's env; here it travels with the other limits). Unset means ``default``.
- ``CUDA_TASK_PRIORITY``: the container's ``nvidia.com/priority`` when it names one (upstream's
  webhook puts it in the container's env; here it travels with the other limits).
- ``LIBCUDA_LOG_LEVEL``: set only when configured (upstream: ``libCudaLogLevel``, node-overridable).
- Mounts: ``<hook>/libvgpu.so`` read-only at the same path; the host directory
  ``<hook>/containers/<podUID>_<containerName>`` read-write at ``<hook>``; the limits file
  ``<hook>/containers/<podUID>_<containerName>/limits`` read-only at ``<hook>/limits``;
  ``<hook>/ld.so.preload`` read-only at ``/etc/ld.so.preload``, always (upstream leaves it out when
  the container's env sets ``CUDA_DISABLE_CONTROL``: a pod must not opt itself out of its limits).
  Container paths equal host paths under ``<hook>`` so the one ``ld.so.preload`` file names the
  interposer correctly on both sides. Upstream's read-write ``/tmp/vgpulock``, a host directory
  every GPU container shares (HAMi-core's device-initialisation lock), is not mounted: our
  interposer takes no lock there, and a directory shared writable across tenants' containers is a
  channel between them.
- The limits file holds the env above, one ``NAME=value`` per line, without
  ``NVIDIA_VISIBLE_DEVICES`` and ``LIBCUDA_LOG_LEVEL`` (``limits_file_text``).
- Upstream also mounts a license and a validator binary when ``<hook>/license`` exists; that is a
  commercial add-on and is left out.

Refused with ``ProtocolError`` (upstream passes them through): no devices, more than 16 devices
(the interposer tracks 16), memory of 0 MiB or less (the interposer reads 0 as *no limit*), cores
outside 0-100, and pod UIDs, container names or cache ids that are not plain file names (they
become host paths).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Final, Literal, get_args

from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.errors import ProtocolError

__all__ = [
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

CorePolicy = Literal["default", "force", "disable"]
CORE_POLICIES: Final[tuple[CorePolicy, ...]] = get_args(CorePolicy)

DEFAULT_HOOK_PATH: Final = "/usr/local/vgpu"
LD_SO_PRELOAD: Final = "/etc/ld.so.preload"
LIMITS_FILE: Final = "limits"
"""The limits file's name, beside ``libvgpu.so`` in the container (``<hook>/limits``), where the
interposer looks for it."""
MAX_DEVICES: Final = 16
"""Devices the interposer and the region file track (``CUDA_DEVICE_MEMORY_LIMIT_0..15``)."""

ENV_VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
ENV_MEMORY_LIMIT: Final = "CUDA_DEVICE_MEMORY_LIMIT"
ENV_SM_LIMIT: Final = "CUDA_DEVICE_SM_LIMIT"
ENV_SHARED_CACHE: Final = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
ENV_OVERSUBSCRIBE: Final = "CUDA_OVERSUBSCRIBE"
ENV_CORE_POLICY: Final = "GPU_CORE_UTILIZATION_POLICY"
ENV_LOG_LEVEL: Final = "LIBCUDA_LOG_LEVEL"
ENV_DISABLE_CONTROL: Final = "CUDA_DISABLE_CONTROL"
"""HAMi's opt-out of the interposer; a pod may not set it (the admission policies refuse it)."""
ENV_TASK_PRIORITY: Final = "CUDA_TASK_PRIORITY"
"""From the container's ``nvidia.com/priority``, read by the interposer (default 1)
(docs/wire-format.md#allocate-response)."""
_NOT_LIMITS: Final = frozenset({ENV_VISIBLE_DEVICES, ENV_LOG_LEVEL})
"""Allocate env the limits file leaves out: the container runtime reads the first, and the second
is the pod's own to raise."""

_LIBRARY: Final = "libvgpu.so"
_PRELOAD: Final = "ld.so.preload"
# A plain file name: starts with a letter or digit (so never "." or ".."), no "/".
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_LIMIT: Final = re.compile(r"([0-9]{1,20})([kKmMgG]?)")
_LIMIT_SHIFT: Final = {"": 0, "k": 10, "m": 20, "g": 30}


@dataclasses.dataclass(frozen=True, slots=True)
class Mount:
    """One device plugin ``Mount``: a host path bound at a container path."""

    container_path: str
    host_path: str
    read_only: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """One ``ContainerAllocateResponse``'s env and mounts, and the limits file to write first."""

    envs: Mapping[str, str]
    mounts: tuple[Mount, ...]
    limits_path: str
    """The host path of the limits file (``limits_host_path``)."""
    limits_text: str


def _hook(hook_path: str) -> str:
    if not hook_path.startswith("/") or "\0" in hook_path or "/../" in f"{hook_path}/":
        raise ProtocolError("hookPath", hook_path, "must be an absolute path without '..'")
    return hook_path.rstrip("/") or "/"


def _name(field: str, value: str) -> str:
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise ProtocolError(field, value, "must be a plain file name (letters, digits, '.', '_', '-')")
    return value


def region_dir_name(pod_uid: str, container_name: str) -> str:
    """The name of one container's region directory, ``<podUID>_<containerName>``: one name per
    container of a pod on the node (``parse_region_dir_name`` reads it back)."""
    return f"{_name('pod uid', pod_uid)}_{_name('container name', container_name)}"


def region_host_dir(hook_path: str, pod_uid: str, container_name: str) -> str:
    """The host directory holding one container's region file:
    ``<hook>/containers/<podUID>_<containerName>``."""
    return f"{_hook(hook_path)}/containers/{region_dir_name(pod_uid, container_name)}"


def limits_host_path(hook_path: str, pod_uid: str, container_name: str) -> str:
    """The host file holding one container's limits: ``limits`` in its region directory, mounted
    read-only over that path in the container, so its processes cannot change it."""
    return f"{region_host_dir(hook_path, pod_uid, container_name)}/{LIMITS_FILE}"


def limits_file_text(env: Mapping[str, str]) -> str:
    """The limits file of an Allocate ``env``: ``NAME=value`` lines (module docstring)."""
    return "".join(f"{name}={value}\n" for name, value in env.items() if name not in _NOT_LIMITS)


def parse_region_dir_name(name: str) -> tuple[str, str]:
    """The (pod UID, container name) of a directory name ``region_host_dir`` made, for the monitor
    reading the directories back. Pod UIDs and container names hold no ``_``, so the first one
    splits them; anything ``region_host_dir`` would not make is a ``ProtocolError``."""
    pod_uid, sep, container = name.partition("_")
    if not sep:
        raise ProtocolError("region directory", name, "expected <podUID>_<containerName>")
    return _name("pod uid", pod_uid), _name("container name", container)


def shared_cache_path(hook_path: str, cache_id: str) -> str:
    """The region file's path inside the container: ``<hook>/<cache_id>.cache``."""
    return f"{_hook(hook_path)}/{_name('cache id', cache_id)}.cache"


def _check_devices(devices: Sequence[ContainerDevice]) -> None:
    if not devices:
        raise ProtocolError("devices", list(devices), "a container allocation needs at least one device")
    if len(devices) > MAX_DEVICES:
        raise ProtocolError("devices", len(devices), f"the interposer tracks at most {MAX_DEVICES} devices")
    for i, dev in enumerate(devices):
        if dev.usedmem <= 0:
            raise ProtocolError(
                f"devices[{i}].usedmem", dev.usedmem, "must be positive (0 MiB would mean no memory limit)"
            )
        if not 0 <= dev.usedcores <= 100:
            raise ProtocolError(f"devices[{i}].usedcores", dev.usedcores, "must be 0-100")
        if not dev.uuid or "," in dev.uuid:
            raise ProtocolError(f"devices[{i}].uuid", dev.uuid, "must be a non-empty UUID without ','")


def allocation_env(
    devices: Sequence[ContainerDevice],
    *,
    cache_id: str,
    hook_path: str = DEFAULT_HOOK_PATH,
    memory_scaling: float = 1.0,
    core_policy: CorePolicy = "default",
    disable_core_limit: bool = False,
    log_level: int | None = None,
    task_priority: int | None = None,
) -> dict[str, str]:
    """The env of one container's Allocate response (module docstring has the rules)."""
    _check_devices(devices)
    if core_policy not in CORE_POLICIES:
        raise ProtocolError("gpuCorePolicy", core_policy, f"must be one of {', '.join(CORE_POLICIES)}")
    if log_level is not None and not 0 <= log_level <= 4:
        raise ProtocolError("libCudaLogLevel", log_level, "must be 0-4")

    env = {ENV_VISIBLE_DEVICES: ",".join(dev.uuid for dev in devices)}
    for i, dev in enumerate(devices):
        env[f"{ENV_MEMORY_LIMIT}_{i}"] = f"{dev.usedmem}m"
    env[ENV_SM_LIMIT] = str(devices[0].usedcores)
    if len({dev.usedcores for dev in devices}) > 1:
        for i, dev in enumerate(devices):
            env[f"{ENV_SM_LIMIT}_{i}"] = str(dev.usedcores)
    env[ENV_SHARED_CACHE] = shared_cache_path(hook_path, cache_id)
    if memory_scaling > 1:
        env[ENV_OVERSUBSCRIBE] = "true"
    if disable_core_limit:
        env[ENV_CORE_POLICY] = "disable"
    elif core_policy != "default":
        env[ENV_CORE_POLICY] = core_policy
    if task_priority is not None:
        env[ENV_TASK_PRIORITY] = str(task_priority)
    if log_level is not None:
        env[ENV_LOG_LEVEL] = str(log_level)
    return env


def allocation_mounts(
    *, hook_path: str = DEFAULT_HOOK_PATH, pod_uid: str, container_name: str
) -> list[Mount]:
    """The mounts of one container's Allocate response (module docstring)."""
    hook = _hook(hook_path)
    return [
        Mount(container_path=f"{hook}/{_LIBRARY}", host_path=f"{hook}/{_LIBRARY}", read_only=True),
        Mount(
            container_path=hook,
            host_path=region_host_dir(hook, pod_uid, container_name),
            read_only=False,
        ),
        Mount(
            container_path=f"{hook}/{LIMITS_FILE}",
            host_path=limits_host_path(hook, pod_uid, container_name),
            read_only=True,
        ),
        Mount(container_path=LD_SO_PRELOAD, host_path=f"{hook}/{_PRELOAD}", read_only=True),
    ]


def container_allocation(
    devices: Sequence[ContainerDevice],
    *,
    pod_uid: str,
    container_name: str,
    cache_id: str,
    hook_path: str = DEFAULT_HOOK_PATH,
    memory_scaling: float = 1.0,
    core_policy: CorePolicy = "default",
    disable_core_limit: bool = False,
    log_level: int | None = None,
    task_priority: int | None = None,
) -> ContainerAllocation:
    """Env, mounts and limits file together, for the container named ``container_name``."""
    envs = allocation_env(
        devices,
        cache_id=cache_id,
        hook_path=hook_path,
        memory_scaling=memory_scaling,
        core_policy=core_policy,
        disable_core_limit=disable_core_limit,
        log_level=log_level,
        task_priority=task_priority,
    )
    mounts = allocation_mounts(hook_path=hook_path, pod_uid=pod_uid, container_name=container_name)
    return ContainerAllocation(
        envs=envs,
        mounts=tuple(mounts),
        limits_path=limits_host_path(hook_path, pod_uid, container_name),
        limits_text=limits_file_text(envs),
    )


def memory_limit_bytes(value: str) -> int:
    """Bytes of a ``CUDA_DEVICE_MEMORY_LIMIT[_<n>]`` value as the interposer reads it
    (docs/wire-format.md#interposer-environment): digits with an optional ``k``/``m``/``g`` suffix in
    powers of 1024, either case; 0 means no limit. ``"3000m"`` is 3,145,728,000."""
    match = _LIMIT.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ProtocolError(ENV_MEMORY_LIMIT, value, "must be digits with an optional k, m or g suffix")
    number = int(match[1]) << _LIMIT_SHIFT[match[2].lower()]
    if number >= 2**64:
        raise ProtocolError(ENV_MEMORY_LIMIT, value, "does not fit in 64 bits")
    return number
