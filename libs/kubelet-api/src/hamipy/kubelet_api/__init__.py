"""The kubelet device plugin API v1beta1 as Python gRPC stubs.

Shared by the device plugin (``hamipy.device_plugin``), which serves ``DevicePlugin`` and calls
``Registration``, and the kubelet stand-in (``hamipy.devcluster``), which does the opposite. The
stubs in ``v1beta1`` are generated from ``proto/`` and committed, so installing the package needs
no code generator.
"""

from __future__ import annotations

from typing import Final

__all__ = ["HEALTHY", "KUBELET_SOCKET", "UNHEALTHY", "VERSION"]

VERSION: Final = "v1beta1"
"""``RegisterRequest.version``: the API version the plugin speaks."""
KUBELET_SOCKET: Final = "kubelet.sock"
"""The kubelet's registration socket, in the device-plugin directory."""
HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"
