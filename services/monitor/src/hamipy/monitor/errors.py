"""The exception tree of the monitor.

    Exception
     └── MonitorError         something the monitor could not do; the message names the object
          ├── NvmlError       NVML could not be loaded or answered an error (host GPU metrics)
          └── RegionError     one region file cannot be read; ``reason`` is its metric label
                              (``truncated``, ``foreign``, ``version``, ``malformed``, ...)

Kubernetes errors are ``hamipy.kube.errors``' (``KubeError``, ``Gone``, ...), shared by every
service; the pod informer retries them. Library errors (pynvml, ``OSError`` and ``ProtocolError``
from a region file) are translated at the boundary in ``host_gpus`` and ``region_files``. None of
them stops the monitor: each costs one object its metrics, with a log line and a counter. A
background task that dies is not an exception here: the monitor's supervisor logs it and ends the
process (``hamipy.serving.supervision``).
"""

from __future__ import annotations

__all__ = ["MonitorError", "NvmlError", "RegionError"]


class MonitorError(Exception):
    """Base of every error raised by the monitor."""


class NvmlError(MonitorError):
    """NVML failed: not loadable, or a call returned an error."""


class RegionError(MonitorError):
    """A region file that cannot be read; ``reason`` is a short label, the message names the file."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
