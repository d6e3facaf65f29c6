"""The exception tree of the monitor.

    Exception
     └── MonitorError         something the monitor could not do; the message names the object
          ├── KubeError       the API server answered an error or could not be reached
          │    └── Gone       410: the watch's resourceVersion is too old (list again)
          ├── NvmlError       NVML could not be loaded or answered an error (host GPU metrics)
          └── RegionError     one region file cannot be read; ``reason`` is its metric label
                              (``truncated``, ``foreign``, ``version``, ``malformed``, ...)

Library errors (kubernetes-asyncio, aiohttp, pynvml, ``OSError`` and ``ProtocolError`` from a region
file) are translated at the boundary in ``kube``, ``host_gpus`` and ``region_files``. None of them
stops the monitor: each costs one object its metrics, with a log line and a counter.
"""

from __future__ import annotations

__all__ = ["Gone", "KubeError", "MonitorError", "NvmlError", "RegionError"]


class MonitorError(Exception):
    """Base of every error raised by the monitor."""


class KubeError(MonitorError):
    """An API call failed; ``status`` is the HTTP status (0 when no answer came)."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Gone(KubeError):
    """A watch asked for a resourceVersion the server no longer has (HTTP 410): list again."""


class NvmlError(MonitorError):
    """NVML failed: not loadable, or a call returned an error."""


class RegionError(MonitorError):
    """A region file that cannot be read; ``reason`` is a short label, the message names the file."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
