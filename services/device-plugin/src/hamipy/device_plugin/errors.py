"""The exception tree of the device plugin.

    Exception
     └── DevicePluginError        something the plugin could not do; the message names the object
          ├── NvmlError           NVML could not be loaded or answered an error (discovery, health)
          ├── MigError            a MIG instance could not be made, found, adopted or destroyed
          └── AllocateError       an Allocate request cannot be served; the message is the gRPC
               │                  status detail the kubelet shows on the pod (FAILED_PRECONDITION)
               ├── UnknownDevice  it names device IDs that are not this plugin's (INVALID_ARGUMENT)
               └── KubeletUnreachable  the kubelet's PodResources API did not say which pod it is
                                  admitting: nobody is served

Kubernetes errors are ``hamipy.kube.errors``' (``KubeError``, ``Conflict``, ...), shared by every
service. Library errors (pynvml) are translated at the boundary in ``discovery``. A background task
that dies is not an exception here: the plugin's supervisor logs it and ends the process
(``hamipy.serving.supervision``).
"""

from __future__ import annotations

__all__ = [
    "AllocateError",
    "DevicePluginError",
    "KubeletUnreachable",
    "MigError",
    "NvmlError",
    "UnknownDevice",
]


class DevicePluginError(Exception):
    """Base of every error raised by the device plugin."""


class NvmlError(DevicePluginError):
    """NVML failed: not loadable, or a call returned an error."""


class MigError(DevicePluginError):
    """A MIG instance could not be made, adopted or destroyed; the message names the GPU, the
    profile and placement or the MIG UUID."""


class AllocateError(DevicePluginError):
    """An Allocate that cannot be served (no pod waiting for it, a malformed annotation...)."""


class UnknownDevice(AllocateError):
    """An Allocate names device IDs this plugin never advertised: no pod is looked at."""


class KubeletUnreachable(AllocateError):
    """The kubelet's PodResources API could not be read: the pod being admitted is not known."""
