"""The exception tree of the device plugin.

    Exception
     └── DevicePluginError        something the plugin could not do; the message names the object
          ├── NvmlError           NVML could not be loaded or answered an error (discovery, health)
          ├── KubeError           the API server answered an error or could not be reached
          │    └── Conflict       409: a resourceVersion precondition failed (someone wrote first)
          └── AllocateError       an Allocate request cannot be served; the message is the gRPC
                                  status detail the kubelet shows on the pod

Library errors (pynvml, kubernetes-asyncio, aiohttp) are translated at the boundary in
``discovery`` and ``kube``.
"""

from __future__ import annotations

__all__ = ["AllocateError", "Conflict", "DevicePluginError", "KubeError", "NvmlError"]


class DevicePluginError(Exception):
    """Base of every error raised by the device plugin."""


class NvmlError(DevicePluginError):
    """NVML failed: not loadable, or a call returned an error."""


class KubeError(DevicePluginError):
    """An API call failed; ``status`` is the HTTP status (0 when no answer came)."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Conflict(KubeError):
    """A write lost a resourceVersion race (HTTP 409)."""


class AllocateError(DevicePluginError):
    """An Allocate that cannot be served (no pod waiting for it, a malformed annotation...)."""
