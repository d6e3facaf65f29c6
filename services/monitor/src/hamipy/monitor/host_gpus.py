"""Host GPU use from NVML through ``pynvml``: memory and utilization per GPU, and per MIG instance
of a MIG-enabled GPU (docs/design.md#3-real-nvml-or-a-fake-driver).

The same code runs over the real ``libnvidia-ml.so.1`` and over native/'s fake one. NVML calls
block, so callers run ``sample`` in a worker thread (the scrape does). NVML is initialised on the
first sample and kept; if that fails it is tried again at most every ``retry_s``. A call that fails
for one GPU leaves out that GPU's value (never a zero in its place), is counted in
``hamipy_monitor_nvml_errors_total{call}`` and logged when it starts or stops failing. A value NVML
does not give for a device (``NOT_SUPPORTED``: the utilization of a MIG-enabled GPU, memory on a
unified-memory board) is left out too, logged once per device and call, and not counted as an error.

MIG instances come and go with the pods (dynamic MIG), so they are listed on every sample, unlike
the GPUs, which are listed once: a MIG-enabled GPU's instances are the MIG device handles NVML
gives for it, each with its own memory (its UUID, GPU and compute instance ids, and the profile
from its name, ``<GPU name> MIG <profile>``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

import pynvml
import structlog

from hamipy.monitor.errors import NvmlError
from hamipy.monitor.gpu_samples import HostGpuSample, MigDeviceSample, mig_profile
from hamipy.monitor.telemetry import Metrics
from hamipy.protocol.node_devices import device_type

__all__ = ["HostGpus", "NvmlHostGpus"]

_T = TypeVar("_T")
_RETRY_S: Final = 30.0


class HostGpus(Protocol):
    """A source of host GPU samples (``NvmlHostGpus``, or a fake in tests)."""

    def sample(self) -> list[HostGpuSample]: ...

    def close(self) -> None: ...


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclasses.dataclass(frozen=True, slots=True)
class _Device:
    index: int
    handle: Any
    uuid: str
    device_type: str


_Key = tuple[str, int | None, str]


def _key(where: dict[str, Any], call: str) -> _Key:
    """A call on a GPU, or on one of its MIG slots: by slot rather than by MIG UUID, so that
    instances made and destroyed over the months do not grow the monitor's memory."""
    return (str(where["device_uuid"]), where.get("mig_index"), call)


class NvmlHostGpus:
    """Host GPU samples from NVML; thread-safe."""

    def __init__(
        self,
        *,
        logger: structlog.typing.FilteringBoundLogger,
        metrics: Metrics,
        retry_s: float = _RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.metrics = metrics
        self.retry_s = retry_s
        self.clock = clock
        self._lock = threading.Lock()
        self._devices: list[_Device] | None = None
        self._next_try = 0.0
        # Calls failing now, and those NVML said it does not support (logged once), by ``_key``.
        self._failing: set[_Key] = set()
        self._unsupported: set[_Key] = set()

    def sample(self) -> list[HostGpuSample]:
        """Every GPU's memory use and utilization; ``NvmlError`` when NVML is not available."""
        with self._lock:
            devices = self._init()
            return [self._sample(d) for d in devices]

    def close(self) -> None:
        with self._lock:
            if self._devices is not None:
                self._devices = None
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError as exc:
                    self.logger.warning("NVML shutdown failed", error=str(exc))

    def _init(self) -> list[_Device]:
        if self._devices is not None:
            return self._devices
        now = self.clock()
        if now < self._next_try:
            raise NvmlError("NVML is not available (next attempt later)")
        self._next_try = now + self.retry_s
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.metrics.nvml_errors.labels(call="nvmlInit").inc()
            self.logger.error("NVML could not be initialised; no host GPU metrics", error=str(exc))
            raise NvmlError(f"NVML could not be initialised: {exc}") from exc
        try:
            devices = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                devices.append(
                    _Device(
                        index=index,
                        handle=handle,
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                        device_type=device_type(_text(pynvml.nvmlDeviceGetName(handle))),
                    )
                )
        except pynvml.NVMLError as exc:
            self.metrics.nvml_errors.labels(call="discovery").inc()
            self.logger.error("NVML device discovery failed; no host GPU metrics", error=str(exc))
            pynvml.nvmlShutdown()
            raise NvmlError(f"NVML device discovery failed: {exc}") from exc
        self.logger.info("NVML ready", gpus=[(d.index, d.uuid, d.device_type) for d in devices])
        self._devices = devices
        return devices

    def _sample(self, d: _Device) -> HostGpuSample:
        where = {"device_index": d.index, "device_uuid": d.uuid}
        memory = self._call(
            where, "nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(d.handle)
        )
        rates = self._call(
            where, "nvmlDeviceGetUtilizationRates", lambda: pynvml.nvmlDeviceGetUtilizationRates(d.handle)
        )
        mig_enabled = self._mig_enabled(d, where)
        return HostGpuSample(
            index=d.index,
            uuid=d.uuid,
            device_type=d.device_type,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization_percent=None if rates is None else int(rates.gpu),
            mig_enabled=mig_enabled,
            mig_devices=self._mig_devices(d, where) if mig_enabled else (),
        )

    def _mig_enabled(self, d: _Device, where: dict[str, Any]) -> bool | None:
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(d.handle)
        except pynvml.NVMLError_NotSupported:
            return False  # a GPU without MIG: the normal case, nothing to report
        except pynvml.NVMLError as exc:
            self._failed(where, "nvmlDeviceGetMigMode", exc)
            return None
        self._answered(where, "nvmlDeviceGetMigMode")
        return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)

    def _mig_devices(self, d: _Device, where: dict[str, Any]) -> tuple[MigDeviceSample, ...]:
        count = self._call(
            where, "nvmlDeviceGetMaxMigDeviceCount", lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(d.handle)
        )
        found = []
        for i in range(count or 0):
            try:
                handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(d.handle, i)
            except pynvml.NVMLError_NotFound:
                continue  # no instance in this slot
            except pynvml.NVMLError as exc:
                self._failed({**where, "mig_index": i}, "nvmlDeviceGetMigDeviceHandleByIndex", exc)
                continue
            self._answered({**where, "mig_index": i}, "nvmlDeviceGetMigDeviceHandleByIndex")
            mig = self._mig_device({**where, "mig_index": i}, handle)
            if mig is not None:
                found.append(mig)
        return tuple(found)

    def _mig_device(self, where: dict[str, Any], handle: Any) -> MigDeviceSample | None:
        uuid = self._call(where, "nvmlDeviceGetUUID", lambda: _text(pynvml.nvmlDeviceGetUUID(handle)))
        if uuid is None:
            return None  # nothing to name its series by; the failure is logged
        where = {**where, "mig_uuid": uuid}
        name = self._call(where, "nvmlDeviceGetName", lambda: _text(pynvml.nvmlDeviceGetName(handle)))
        memory = self._call(where, "nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
        gi = self._call(
            where, "nvmlDeviceGetGpuInstanceId", lambda: int(pynvml.nvmlDeviceGetGpuInstanceId(handle))
        )
        ci = self._call(
            where,
            "nvmlDeviceGetComputeInstanceId",
            lambda: int(pynvml.nvmlDeviceGetComputeInstanceId(handle)),
        )
        return MigDeviceSample(
            uuid=uuid,
            profile="" if name is None else mig_profile(name),
            gpu_instance_id=gi,
            compute_instance_id=ci,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
        )

    def _call(self, where: dict[str, Any], call: str, fn: Callable[[], _T]) -> _T | None:
        """``fn()``, or None (logged, and counted unless NVML does not support it) when it fails."""
        try:
            value = fn()
        except pynvml.NVMLError_NotSupported:
            key = _key(where, call)
            if key not in self._unsupported:
                self._unsupported.add(key)
                self.logger.info(
                    "NVML does not give this value for the device; it is left out", call=call, **where
                )
            return None
        except pynvml.NVMLError as exc:
            self._failed(where, call, exc)
            return None
        self._answered(where, call)
        return value

    def _failed(self, where: dict[str, Any], call: str, exc: pynvml.NVMLError) -> None:
        self.metrics.nvml_errors.labels(call=call).inc()
        key = _key(where, call)
        if key not in self._failing:
            self._failing.add(key)
            self.logger.warning("NVML call failed", call=call, error=str(exc), **where)

    def _answered(self, where: dict[str, Any], call: str) -> None:
        key = _key(where, call)
        if key in self._failing:
            self._failing.discard(key)
            self.logger.info("NVML call answers again", call=call, **where)
