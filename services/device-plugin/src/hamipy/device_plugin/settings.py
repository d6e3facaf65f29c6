"""Settings of the device plugin beyond the shared configuration (hamipy.protocol.config.Config),
each declared once with its flag and variable (``hamipy.protocol.settings``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Final

from hamipy.kubelet_api import POD_RESOURCES_SOCKET
from hamipy.protocol.settings import OWN, declare, tuning, user

__all__ = ["DEFAULT_PLUGIN_DIR", "DEFAULT_POD_RESOURCES_SOCKET", "DEFAULT_SOCKET_NAME", "PluginSettings"]

DEFAULT_PLUGIN_DIR: Final = Path("/var/lib/kubelet/device-plugins")
DEFAULT_SOCKET_NAME: Final = "hamipy-nvidia.sock"
DEFAULT_POD_RESOURCES_SOCKET: Final = Path(POD_RESOURCES_SOCKET)


@dataclasses.dataclass(frozen=True, slots=True)
class PluginSettings:
    """How the device plugin serves, registers and watches. Times are in seconds."""

    node_name: str = dataclasses.field(
        metadata=declare("this node's name (from the downward API)", kind="user", env=(OWN, "NODE_NAME"))
    )
    """The Node this plugin runs on (the downward API's ``spec.nodeName``)."""
    plugin_dir: Path = user(
        DEFAULT_PLUGIN_DIR, "the kubelet's device-plugin directory (kubelet.sock and our socket)"
    )
    socket_name: str = user(
        DEFAULT_SOCKET_NAME, "our socket's file name in --plugin-dir (the endpoint registered)"
    )
    pod_resources_socket: Path = user(
        DEFAULT_POD_RESOURCES_SOCKET,
        "the kubelet's PodResources API socket: which pod it is admitting, asked at every Allocate",
    )
    register_interval_s: float = user(
        30.0, "seconds between node register/handshake writes (keep well under 60)"
    )
    """How often the register annotation and a ``Reported`` handshake are written even when nothing
    changed. HAMi's scheduler counts a node dead 60 s after an unanswered ``Requesting_`` stamp, so
    this must stay well under 60 s."""
    socket_check_interval_s: float = 1.0
    """How often the plugin checks that its socket and ``kubelet.sock`` are still there: a restarted
    kubelet deletes every socket, and the plugin must serve and register again."""
    health_poll_s: float = 5.0
    """NVML event wait (and, where events are not supported, polling) period for GPU health."""
    mig_reconcile_interval_s: float = 5.0
    """How often a ``mig`` node's dynamic MIG instances are reconciled with its pods (HAMi's period)."""
    api_timeout_s: float = tuning(10.0, "seconds per Kubernetes API call")
    grpc_timeout_s: float = 10.0
    """Per call to the kubelet (Register, PodResources List)."""
    metrics_host: str = user("0.0.0.0", "listen address of /metrics, /healthz, /readyz")
    metrics_port: int = user(9395, "/metrics, /healthz, /readyz; 0 picks a free port")
    interposer: Path | None = user(
        None, "libvgpu.so to install with ld.so.preload into the configured hookPath at start"
    )
    """The image's entrypoint names the one it ships."""
