"""The kubelet's device plugin API v1beta1 and PodResources API v1 as Python gRPC stubs.

Shared by the device plugin (``hamipy.device_plugin``), which serves ``DevicePlugin``, calls
``Registration`` and reads ``PodResourcesLister``, and the kubelet stand-in (``hamipy.devcluster``),
which does the opposite. The stubs in ``v1beta1`` and ``podresources_v1`` are generated from
``proto/`` and committed, so installing the package needs no code generator.
"""

from __future__ import annotations

from typing import Final

__all__ = ["HEALTHY", "KUBELET_SOCKET", "POD_RESOURCES_SOCKET", "UNHEALTHY", "VERSION"]

VERSION: Final = "v1beta1"
"""``RegisterRequest.version``: the API version the plugin speaks."""
KUBELET_SOCKET: Final = "kubelet.sock"
"""The kubelet's registration socket, in the device-plugin directory."""
POD_RESOURCES_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
"""Where a kubelet with the default root directory serves the PodResources API."""
HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"
