"""Host GPU use from NVML through ``pynvml``: memory and utilization per GPU
(docs/design.md#3-real-nvml-or-a-fake-driver).

The same code runs over the real ``libnvidia-ml.so.1`` and over native/'s fake one. NVML calls
block, so callers run ``sample`` in a worker thread (the scrape does). NVML is initialised on the
first sample and kept; if that fails it is tried again at most every ``retry_s``. A call that fails
for one GPU leaves out that GPU's value (never a zero in its place), is counted in
``hamipy_monitor_nvml_errors_total{call}`` and logged when it starts or stops failing.
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
from hamipy.monitor.telemetry import Metrics
from hamipy.protocol.node_devices import device_type

__all__ = ["HostGpuSample", "HostGpus", "NvmlHostGpus"]

_T = TypeVar("_T")
_RETRY_S: Final = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class HostGpuSample:
    """One GPU as NVML reports it now; None where NVML could not say."""

    index: int
    uuid: str
    device_type: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_percent: int | None


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
        self._failing: set[tuple[int, str]] = set()

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
        memory = self._call(d, "nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(d.handle))
        rates = self._call(
            d, "nvmlDeviceGetUtilizationRates", lambda: pynvml.nvmlDeviceGetUtilizationRates(d.handle)
        )
        return HostGpuSample(
            index=d.index,
            uuid=d.uuid,
            device_type=d.device_type,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization_percent=None if rates is None else int(rates.gpu),
        )

    def _call(self, d: _Device, call: str, fn: Callable[[], _T]) -> _T | None:
        key = (d.index, call)
        try:
            value = fn()
        except pynvml.NVMLError_NotSupported:
            return None  # the GPU does not have it: not an error
        except pynvml.NVMLError as exc:
            self.metrics.nvml_errors.labels(call=call).inc()
            if key not in self._failing:
                self._failing.add(key)
                self.logger.warning(
                    "NVML call failed", call=call, device_index=d.index, device_uuid=d.uuid, error=str(exc)
                )
            return None
        if key in self._failing:
            self._failing.discard(key)
            self.logger.info("NVML call answers again", call=call, device_index=d.index, device_uuid=d.uuid)
        return value
