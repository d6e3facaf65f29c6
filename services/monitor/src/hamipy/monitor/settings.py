"""Settings of the monitor beyond the shared configuration (``hamipy.protocol.config.Config``), each
declared once with its flag and variable (``hamipy.protocol.settings``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Final

from hamipy.protocol.allocation_env import DEFAULT_HOOK_PATH
from hamipy.protocol.settings import OWN, declare, tuning, user

__all__ = ["DEFAULT_METRICS_PORT", "HookPathOverride", "MonitorSettings"]

DEFAULT_METRICS_PORT: Final = 9394
"""HAMi's vGPU monitor port, so existing scrape configs keep working."""


@dataclasses.dataclass(frozen=True, slots=True)
class MonitorSettings:
    """How the monitor reads, serves and gives feedback. Times are in seconds."""

    node_name: str = dataclasses.field(
        metadata=declare("this node's name (from the downward API)", kind="user", env=(OWN, "NODE_NAME"))
    )
    """The Node this monitor runs on (the downward API's ``spec.nodeName``): its pods are watched."""
    hook_path: Path = Path(DEFAULT_HOOK_PATH)
    """The host's hook directory (``nvidia.hookPath``, or ``HookPathOverride``); region files live in
    ``<hook>/containers``."""
    metrics_host: str = user("0.0.0.0", "listen address of /metrics, /healthz, /readyz")
    metrics_port: int = user(
        DEFAULT_METRICS_PORT,
        "/metrics, /healthz, /readyz (HAMi's monitor port by default); 0 picks a free port",
    )
    legacy_metrics: bool = user(False, "also export HAMi's pre-2.9 metric names for old dashboards")
    """Also export HAMi's pre-2.9 metric names (``vGPU_device_memory_usage_in_bytes``, ...) for old
    dashboards. Off by default: it doubles the series."""
    host_metrics: bool = user(True, "export host GPU metrics from NVML")
    """Export host GPU metrics from NVML. Off only where NVML is absent on purpose (tests)."""
    feedback: bool = user(
        True, "write the priority feedback (recent_kernel, utilization_switch) into region files"
    )
    """Run the priority feedback (``recent_kernel`` / ``utilization_switch``, ``feedback.py``)."""
    feedback_interval_s: float = tuning(5.0, "seconds between feedback and housekeeping passes")
    """Period of the feedback and housekeeping pass. HAMi's monitor uses 5 s; the interposer marks
    a kernel launch with ``recent_kernel = 2``, so a container counts as active for one to two
    periods after its last launch."""
    gone_grace_s: float = tuning(
        300.0, "seconds a pod must be gone before its region directories (and CDI specs) are removed"
    )
    """A region directory (or CDI spec) whose pod is gone is removed after this long (HAMi: 5
    minutes), so a pod the watch has not delivered yet never loses its directory."""
    cdi_spec_dir: Path | None = None
    """The CDI spec directory the device plugin writes slot specs into (``nvidia.cdiSpecDir`` under
    the ``cdi-cri`` strategy): those of pods gone are removed with their region directories. None
    (the ``envvar`` strategy): no spec is looked for."""
    api_timeout_s: float = tuning(10.0, "seconds per Kubernetes API call")
    """Per Kubernetes API call (lists; a watch's read timeout is ``watch_inactivity_s``)."""
    watch_timeout_s: int = 300
    """The server ends each watch after this long; it is re-opened from the last resourceVersion."""
    watch_inactivity_s: float = 330.0
    """A watch stream silent for this long (no event, no bookmark) is dropped and re-listed."""
    max_cache_files_per_dir: int = 64
    """Directory entries looked at in one container's region directory. The container can write
    there, so this bounds what a flood of files could cost a scrape."""


@dataclasses.dataclass(frozen=True, slots=True)
class HookPathOverride:
    """This node's hook directory, when it is not the shared configuration's ``nvidia.hookPath``."""

    hook_path: Path | None = user(
        None,
        "host hook directory holding the containers' region directories (default: the configuration's "
        "nvidia.hookPath)",
    )
