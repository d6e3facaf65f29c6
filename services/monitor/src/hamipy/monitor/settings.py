"""Settings of the monitor beyond the shared configuration (``hamipy.protocol.config.Config``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Final

from hamipy.protocol.allocation_env import DEFAULT_HOOK_PATH

__all__ = ["DEFAULT_METRICS_PORT", "MonitorSettings"]

DEFAULT_METRICS_PORT: Final = 9394
"""HAMi's vGPU monitor port, so existing scrape configs keep working."""


@dataclasses.dataclass(frozen=True, slots=True)
class MonitorSettings:
    """How the monitor reads, serves and gives feedback. Times are in seconds."""

    node_name: str
    """The Node this monitor runs on (the downward API's ``spec.nodeName``): its pods are watched."""
    hook_path: Path = Path(DEFAULT_HOOK_PATH)
    """The host's hook directory (``nvidia.hookPath``); region files live in ``<hook>/containers``."""
    metrics_host: str = "0.0.0.0"
    metrics_port: int = DEFAULT_METRICS_PORT
    """``/metrics``, ``/healthz``, ``/readyz``; 0 picks a free port (tests)."""
    legacy_metrics: bool = False
    """Also export HAMi's pre-2.9 metric names (``vGPU_device_memory_usage_in_bytes``, ...) for old
    dashboards. Off by default: it doubles the series."""
    host_metrics: bool = True
    """Export host GPU metrics from NVML. Off only where NVML is absent on purpose (tests)."""
    feedback: bool = True
    """Run the priority feedback (``recent_kernel`` / ``utilization_switch``, ``feedback.py``)."""
    feedback_interval_s: float = 5.0
    """Period of the feedback and housekeeping pass. HAMi's monitor uses 5 s; the interposer marks
    a kernel launch with ``recent_kernel = 2``, so a container counts as active for one to two
    periods after its last launch."""
    gone_grace_s: float = 300.0
    """A region directory (or CDI spec) whose pod is gone is removed after this long (HAMi: 5
    minutes), so a pod the watch has not delivered yet never loses its directory."""
    cdi_spec_dir: Path | None = None
    """The CDI spec directory the device plugin writes slot specs into (``nvidia.cdiSpecDir`` under
    the ``cdi-cri`` strategy): those of pods gone are removed with their region directories. None
    (the ``envvar`` strategy): no spec is looked for."""
    api_timeout_s: float = 10.0
    """Per Kubernetes API call (lists; a watch's read timeout is ``watch_inactivity_s``)."""
    watch_timeout_s: int = 300
    """The server ends each watch after this long; it is re-opened from the last resourceVersion."""
    watch_inactivity_s: float = 330.0
    """A watch stream silent for this long (no event, no bookmark) is dropped and re-listed."""
    max_cache_files_per_dir: int = 64
    """Directory entries looked at in one container's region directory. The container can write
    there, so this bounds what a flood of files could cost a scrape."""
