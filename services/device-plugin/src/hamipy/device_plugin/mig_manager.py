"""MIG instances on this node's GPUs, made and destroyed through NVML (``pynvml``); no Kubernetes.

The scheduler reserves a profile and a placement on a GPU (``MigKey``); ``ensure`` makes exactly that
instance (HAMi's ``migmgr.go`` rules): MIG mode enabled if it is off (a mode change that waits for a
GPU reset is an error), the placement must be one of NVML's possible placements for the profile, a
GPU instance at that placement, one compute instance of the full profile with shared engines, and the
MIG device of that GPU instance gives the UUID. Whatever was made is destroyed when a later step
fails. ``ensure`` is idempotent on the key: a retried Allocate gets the same instance.

Every instance the manager made or adopted is *managed*. ``reconcile`` destroys what no desired key
names: managed instances, and on the GPUs it is given every other GPU instance whose placement no
desired key holds (one a crashed plugin made before it recorded it), compute instances first. A GPU
instance already gone counts as destroyed. ``adopt`` takes a recorded instance back after a restart
once NVML shows a GPU instance with that id at that placement whose MIG device has that UUID.
``reset_idle`` enables MIG mode on GPUs nothing uses and destroys all their instances.

Calls block (NVML): the plugin runs them in worker threads. Each GPU has a lock, so two threads never
change one GPU's instances at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Final, Self

import pynvml

from hamipy.device_plugin.errors import MigError, NvmlError
from hamipy.device_plugin.mig_records import MigKey

__all__ = [
    "CI_PROFILES",
    "GI_PROFILES",
    "LiveInstance",
    "MigInstance",
    "MigManager",
    "Reconciled",
    "nvml_session",
    "nvml_text",
    "slice_prefix",
]

GI_PROFILES: Final = {
    "1g": pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE,
    "2g": pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE,
    "3g": pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE,
    "4g": pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE,
    "6g": pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE,
    "7g": pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE,
    "8g": pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE,
}
"""GPU-instance profile ids by a profile name's slice prefix (``1g`` of ``1g.10gb``), as HAMi maps them."""
CI_PROFILES: Final = {
    "1g": pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    "2g": pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    "3g": pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    "4g": pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    "6g": pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
    "7g": pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
    "8g": pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
}
"""The compute-instance profile that fills a GPU instance of the same slice prefix."""
_ARRAY: Final = 32
"""Entries of the arrays NVML fills (placements, instances): more than any GPU has slices."""
_NO_GRAPHICS_QUERY: Final = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)


def slice_prefix(profile: str) -> str:
    """``1g`` of ``1g.10gb``."""
    return profile.partition(".")[0]


@dataclasses.dataclass(frozen=True, slots=True)
class MigInstance:
    """A live instance realising a ``MigKey``."""

    key: MigKey
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    memory_mib: int
    """The GPU instance profile's memory (NVML's ``memorySizeMB``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LiveInstance:
    """A GPU instance NVML shows on a GPU."""

    gpu_uuid: str
    gpu_instance_id: int
    start: int
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Reconciled:
    """What a ``reconcile`` destroyed, and what it could not destroy (with NVML's error)."""

    destroyed: list[MigInstance | LiveInstance]
    failed: list[tuple[MigInstance | LiveInstance, str]]


class nvml_session:
    """NVML initialised for the block (pynvml counts nested sessions)."""

    def __enter__(self) -> Self:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlError(f"NVML could not be initialised: {exc}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def nvml_text(value: str | bytes) -> str:
    """A string NVML returned (pynvml gives bytes or str by version)."""
    return value.decode() if isinstance(value, bytes) else value


def _profile_ids(profile: str) -> tuple[int, int]:
    prefix = slice_prefix(profile)
    if prefix not in GI_PROFILES:
        raise MigError(f"MIG profile {profile!r} has no known slice prefix (one of {sorted(GI_PROFILES)})")
    return GI_PROFILES[prefix], CI_PROFILES[prefix]


def possible_placements(handle: Any, gi_profile_id: int) -> list[tuple[int, int]]:
    """NVML's possible placements (start, size) of a GPU-instance profile id (``profile_info``'s ``id``)."""
    placements = (pynvml.c_nvmlGpuInstancePlacement_t * _ARRAY)()
    count = ctypes.c_uint(_ARRAY)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, gi_profile_id, placements, ctypes.byref(count))
    return [(int(p.start), int(p.size)) for p in placements[: count.value]]


def _gpu_instances(handle: Any, gi_profile_id: int) -> list[Any]:
    instances = (pynvml.c_nvmlGpuInstance_t * _ARRAY)()
    count = ctypes.c_uint(_ARRAY)
    pynvml.nvmlDeviceGetGpuInstances(handle, gi_profile_id, instances, ctypes.byref(count))
    return list(instances[: count.value])


def _compute_instances(gpu_instance: Any, ci_profile_id: int) -> list[Any]:
    instances = (pynvml.c_nvmlComputeInstance_t * _ARRAY)()
    count = ctypes.c_uint(_ARRAY)
    pynvml.nvmlGpuInstanceGetComputeInstances(gpu_instance, ci_profile_id, instances, ctypes.byref(count))
    return list(instances[: count.value])


def _all_gpu_instances(handle: Any) -> Iterator[Any]:
    """Every GPU instance of the GPU, of every profile NVML knows on it."""
    for profile_id in GI_PROFILES.values():
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_id)
            found = _gpu_instances(handle, info.id)
        except pynvml.NVMLError:
            continue  # a profile this GPU does not have
        yield from found


def _all_compute_instances(gpu_instance: Any) -> Iterator[Any]:
    for profile_id in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gpu_instance, profile_id, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
            found = _compute_instances(gpu_instance, info.id)
        except pynvml.NVMLError:
            continue
        yield from found


def _destroy_gpu_instance(gpu_instance: Any) -> None:
    """Its compute instances first, then it."""
    for compute in list(_all_compute_instances(gpu_instance)):
        pynvml.nvmlComputeInstanceDestroy(compute)
    pynvml.nvmlGpuInstanceDestroy(gpu_instance)


def mig_devices(handle: Any) -> Iterator[Any]:
    """The MIG device handles of a GPU (none where MIG is off)."""
    for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            yield pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError_NotFound:
            continue


def _mig_uuid(handle: Any, gpu_instance_id: int) -> str:
    for device in mig_devices(handle):
        if int(pynvml.nvmlDeviceGetGpuInstanceId(device)) == gpu_instance_id:
            return nvml_text(pynvml.nvmlDeviceGetUUID(device))
    raise MigError(f"no MIG device of GPU instance {gpu_instance_id}")


def _has_processes(handle: Any) -> bool:
    """Whether any process runs on the device; a query that fails counts as busy (HAMi's rule),
    except a driver that cannot report graphics processes at all."""
    try:
        if pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            return True
    except pynvml.NVMLError:
        return True
    try:
        return bool(pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(handle))
    except _NO_GRAPHICS_QUERY:
        return False
    except pynvml.NVMLError:
        return True


def _enable_mig(uuid: str) -> None:
    """MIG mode on (HAMi's ``ensureMigModeEnabled``); an enable or disable that waits for a GPU
    reset is an error."""
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        raise MigError(f"GPU {uuid} does not support MIG") from None
    if current == pynvml.NVML_DEVICE_MIG_ENABLE:
        if pending != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise MigError(f"GPU {uuid}: MIG mode disable is pending (a GPU reset applies it)")
        return
    if pending == pynvml.NVML_DEVICE_MIG_ENABLE:
        raise MigError(f"GPU {uuid}: MIG mode enable is pending; a GPU reset is required")
    pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    current, pending = pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        raise MigError(
            f"GPU {uuid}: MIG mode not enabled after setting it (pending={pending}; a GPU reset is required)"
        )


class MigManager:
    """The single authority over the MIG instances the plugin makes on this node."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gpu_locks: dict[str, threading.Lock] = {}
        self._managed: dict[MigKey, MigInstance] = {}

    def _gpu_lock(self, uuid: str) -> threading.Lock:
        with self._lock:
            return self._gpu_locks.setdefault(uuid, threading.Lock())

    def managed(self) -> list[MigInstance]:
        with self._lock:
            return sorted(self._managed.values(), key=lambda i: i.key)

    def instance(self, key: MigKey) -> MigInstance | None:
        with self._lock:
            return self._managed.get(key)

    def _record(self, instance: MigInstance) -> None:
        with self._lock:
            self._managed[instance.key] = instance

    def _forget(self, key: MigKey) -> None:
        with self._lock:
            self._managed.pop(key, None)

    def ensure(self, key: MigKey) -> tuple[MigInstance, bool]:
        """The instance of ``key``, made now (True) or already managed (False). Raises ``MigError``
        (what was made is destroyed) or ``NvmlError``."""
        with self._gpu_lock(key.gpu_uuid), nvml_session():
            found = self.instance(key)
            if found is not None:
                return found, False
            try:
                instance = self._create(key)
            except pynvml.NVMLError as exc:
                raise MigError(f"MIG instance {key} not made: {exc}") from exc
            self._record(instance)
            return instance, True

    def _create(self, key: MigKey) -> MigInstance:
        gi_profile, ci_profile = _profile_ids(key.profile)
        _enable_mig(key.gpu_uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(key.gpu_uuid)  # again: enabling MIG may reset the GPU
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, gi_profile)
        possible = possible_placements(handle, info.id)
        if (key.start, key.size) not in possible:
            raise MigError(
                f"placement {key.start}+{key.size} is not a possible placement of {key.profile} on GPU "
                f"{key.gpu_uuid} (NVML: {[f'{s}+{n}' for s, n in possible]})"
            )
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = key.start, key.size
        gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, info.id, ctypes.byref(placement)
        )
        compute = None
        try:
            gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gpu_instance).id)
            ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gpu_instance, ci_profile, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
            compute = pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, ci_info.id)
            ci_id = int(pynvml.nvmlComputeInstanceGetInfo(compute).id)
            mig_uuid = _mig_uuid(handle, gi_id)
        except BaseException:
            if compute is not None:
                pynvml.nvmlComputeInstanceDestroy(compute)
            pynvml.nvmlGpuInstanceDestroy(gpu_instance)
            raise
        return MigInstance(key, mig_uuid, gi_id, ci_id, int(info.memorySizeMB))

    def release(self, key: MigKey) -> bool:
        """Destroy the managed instance of ``key`` (True), or nothing when none is managed."""
        with self._gpu_lock(key.gpu_uuid), nvml_session():
            instance = self.instance(key)
            if instance is None:
                return False
            try:
                self._destroy(instance)
            except pynvml.NVMLError as exc:
                raise MigError(f"MIG instance {instance.mig_uuid} ({key}) not destroyed: {exc}") from exc
            self._forget(key)
            return True

    @staticmethod
    def _destroy(instance: MigInstance) -> None:
        handle = pynvml.nvmlDeviceGetHandleByUUID(instance.key.gpu_uuid)
        try:
            gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, instance.gpu_instance_id)
        except pynvml.NVMLError_NotFound:
            return  # already gone
        _destroy_gpu_instance(gpu_instance)

    def live(self, gpu_uuid: str) -> list[LiveInstance]:
        """The GPU instances NVML shows on a GPU."""
        with nvml_session():
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
                return self._live(gpu_uuid, handle)
            except pynvml.NVMLError as exc:
                raise NvmlError(f"MIG instances of GPU {gpu_uuid} not readable: {exc}") from exc

    @staticmethod
    def _live(gpu_uuid: str, handle: Any) -> list[LiveInstance]:
        out = []
        for gpu_instance in _all_gpu_instances(handle):
            info = pynvml.nvmlGpuInstanceGetInfo(gpu_instance)
            out.append(
                LiveInstance(gpu_uuid, int(info.id), int(info.placement.start), int(info.placement.size))
            )
        return sorted(out, key=lambda i: (i.start, i.size))

    def reconcile(self, desired: Collection[MigKey], gpus: Sequence[str]) -> Reconciled:
        """Destroy managed instances not in ``desired`` and, on ``gpus``, every GPU instance whose
        placement no desired key holds. One that cannot be destroyed (a process still on it) is
        reported and left for the next pass."""
        wanted = set(desired)
        done = Reconciled([], [])
        for instance in self.managed():
            if instance.key in wanted:
                continue
            with self._gpu_lock(instance.key.gpu_uuid), nvml_session():
                try:
                    self._destroy(instance)
                except pynvml.NVMLError as exc:
                    done.failed.append((instance, str(exc)))
                    continue
                self._forget(instance.key)
            done.destroyed.append(instance)
        held = {(k.gpu_uuid, k.start, k.size) for k in wanted}
        for gpu in gpus:
            with self._gpu_lock(gpu), nvml_session():
                try:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(gpu)
                    found = [(g, pynvml.nvmlGpuInstanceGetInfo(g)) for g in _all_gpu_instances(handle)]
                except pynvml.NVMLError as exc:
                    done.failed.append((LiveInstance(gpu, -1, -1, -1), str(exc)))
                    continue
                for gpu_instance, info in found:
                    live = LiveInstance(
                        gpu, int(info.id), int(info.placement.start), int(info.placement.size)
                    )
                    if (gpu, live.start, live.size) in held:
                        continue
                    try:
                        _destroy_gpu_instance(gpu_instance)
                    except pynvml.NVMLError as exc:
                        done.failed.append((live, str(exc)))
                        continue
                    done.destroyed.append(live)
        return done

    def adopt(
        self, key: MigKey, *, mig_uuid: str, gpu_instance_id: int, compute_instance_id: int
    ) -> MigInstance:
        """Manage a recorded instance again; ``MigError`` unless NVML shows a GPU instance with that
        id at that placement whose MIG device has ``mig_uuid`` and whose compute instance has that id."""
        gi_profile, _ = _profile_ids(key.profile)
        with self._gpu_lock(key.gpu_uuid), nvml_session():
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(key.gpu_uuid)
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, gi_profile)
                gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, gpu_instance_id)
                gi_info = pynvml.nvmlGpuInstanceGetInfo(gpu_instance)
                placement = (int(gi_info.placement.start), int(gi_info.placement.size))
                if int(gi_info.profileId) != int(info.id) or placement != (key.start, key.size):
                    raise MigError(
                        f"GPU instance {gpu_instance_id} of GPU {key.gpu_uuid} is profile "
                        f"{gi_info.profileId} at {placement[0]}+{placement[1]}, not {key.profile} at "
                        f"{key.start}+{key.size}"
                    )
                actual = _mig_uuid(handle, gpu_instance_id)
                if actual != mig_uuid:
                    raise MigError(
                        f"GPU instance {gpu_instance_id} of GPU {key.gpu_uuid} is MIG device {actual}, "
                        f"not {mig_uuid}"
                    )
                computes = [
                    int(pynvml.nvmlComputeInstanceGetInfo(c).id) for c in _all_compute_instances(gpu_instance)
                ]
                if compute_instance_id not in computes:
                    raise MigError(
                        f"GPU instance {gpu_instance_id} of GPU {key.gpu_uuid} has no compute instance "
                        f"{compute_instance_id} (it has {computes})"
                    )
            except pynvml.NVMLError_NotFound:
                raise MigError(f"no GPU instance {gpu_instance_id} on GPU {key.gpu_uuid}") from None
            except pynvml.NVMLError as exc:
                raise MigError(f"MIG instance {mig_uuid} ({key}) not readable: {exc}") from exc
            instance = MigInstance(
                key, mig_uuid, gpu_instance_id, compute_instance_id, int(info.memorySizeMB)
            )
            self._record(instance)
            return instance

    def busy_gpus(self, gpus: Sequence[str]) -> set[str]:
        """The GPUs with a process on a MIG device or on the GPU itself (a failed query: busy)."""
        busy = set()
        with nvml_session():
            for gpu in gpus:
                try:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(gpu)
                    devices = list(mig_devices(handle)) if _mig_on(handle) else [handle]
                except pynvml.NVMLError:
                    busy.add(gpu)
                    continue
                if any(_has_processes(d) for d in devices):
                    busy.add(gpu)
        return busy

    def reset_idle(self, gpus: Sequence[str], in_use: Collection[str]) -> list[str]:
        """For each GPU of ``gpus`` not ``in_use``: MIG mode on and every instance destroyed;
        returns the GPUs reset. Raises ``MigError`` at the first GPU that could not be reset."""
        reset = []
        for gpu in gpus:
            if gpu in in_use:
                continue
            with self._gpu_lock(gpu), nvml_session():
                try:
                    _enable_mig(gpu)
                    handle = pynvml.nvmlDeviceGetHandleByUUID(gpu)
                    for gpu_instance in list(_all_gpu_instances(handle)):
                        _destroy_gpu_instance(gpu_instance)
                except pynvml.NVMLError as exc:
                    raise MigError(f"GPU {gpu} not reset: {exc}") from exc
                with self._lock:
                    self._managed = {k: v for k, v in self._managed.items() if k.gpu_uuid != gpu}
            reset.append(gpu)
        return reset


def _mig_on(handle: Any) -> bool:
    try:
        current, _ = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return False
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)
