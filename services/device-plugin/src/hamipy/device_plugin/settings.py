"""Settings of the device plugin beyond the shared configuration (hamipy.protocol.config.Config)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Final

from hamipy.kubelet_api import POD_RESOURCES_SOCKET

__all__ = ["DEFAULT_PLUGIN_DIR", "DEFAULT_POD_RESOURCES_SOCKET", "DEFAULT_SOCKET_NAME", "PluginSettings"]

DEFAULT_PLUGIN_DIR: Final = Path("/var/lib/kubelet/device-plugins")
DEFAULT_SOCKET_NAME: Final = "hamipy-nvidia.sock"
DEFAULT_POD_RESOURCES_SOCKET: Final = Path(POD_RESOURCES_SOCKET)


@dataclasses.dataclass(frozen=True, slots=True)
class PluginSettings:
    """How the device plugin serves, registers and watches. Times are in seconds."""

    node_name: str
    """The Node this plugin runs on (the downward API's ``spec.nodeName``)."""
    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    """The kubelet's device-plugin directory: ``kubelet.sock`` and our socket live there."""
    socket_name: str = DEFAULT_SOCKET_NAME
    """Our socket's file name in ``plugin_dir`` (the ``endpoint`` we register)."""
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET
    """The kubelet's PodResources API: which pod it is admitting, asked at every Allocate."""
    register_interval_s: float = 30.0
    """How often the register annotation and a ``Reported`` handshake are written even when nothing
    changed. HAMi's scheduler counts a node dead 60 s after an unanswered ``Requesting_`` stamp, so
    this must stay well under 60 s."""
    socket_check_interval_s: float = 1.0
    """How often the plugin checks that its socket and ``kubelet.sock`` are still there: a restarted
    kubelet deletes every socket, and the plugin must serve and register again."""
    health_poll_s: float = 5.0
    """NVML event wait (and, where events are not supported, polling) period for GPU health."""
    api_timeout_s: float = 10.0
    """Per Kubernetes API call."""
    grpc_timeout_s: float = 10.0
    """Per call to the kubelet (Register, PodResources List)."""
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9395
    """``/metrics``, ``/healthz``, ``/readyz``; 0 picks a free port (tests)."""
