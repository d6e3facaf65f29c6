"""The CDI spec files the device plugin writes for this node's slots in its ``cdi-cri`` strategy
(``hamipy.protocol.cdi``): finding them, and removing one whose pod is gone. The housekeeping pass
removes them with the region directories, by the same rule (``Monitor._remove_gone``): a spec
whose pod has been gone for the grace period, the pod view being fresh, whether its region
directory is still there or not (a spec left by a node that restarted, or a plugin killed between
writing the spec and answering).

Only files named as the device plugin names them (``hami.io-vgpu_<podUID>_<container>.json``) are
looked at: the directory is the runtime's, shared with other vendors' specs (the NVIDIA toolkit's).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import structlog

from hamipy.monitor.telemetry import Metrics
from hamipy.protocol.cdi import parse_spec_file_name
from hamipy.protocol.errors import ProtocolError

__all__ = ["CdiSpecs", "SlotSpec"]


@dataclasses.dataclass(frozen=True, slots=True)
class SlotSpec:
    """One slot's spec file."""

    pod_uid: str
    container: str
    path: Path


class CdiSpecs:
    """The slot specs in one CDI spec directory (blocking file I/O: call from a worker thread)."""

    def __init__(self, spec_dir: Path, *, logger: structlog.typing.FilteringBoundLogger, metrics: Metrics):
        self.spec_dir = spec_dir
        self.logger = logger
        self.metrics = metrics

    def list(self) -> list[SlotSpec]:
        """The slot specs there now (none when the directory is not there yet)."""
        found = []
        try:
            with os.scandir(self.spec_dir) as entries:
                for entry in entries:
                    try:
                        pod_uid, container = parse_spec_file_name(entry.name)
                    except ProtocolError:
                        continue  # another vendor's spec, or one being written
                    if stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                        found.append(SlotSpec(pod_uid, container, Path(entry.path)))
        except FileNotFoundError:
            return []
        except OSError as exc:
            self.logger.warning("CDI spec directory not read", dir=str(self.spec_dir), error=str(exc))
            return []
        return found

    def remove(self, spec: SlotSpec) -> bool:
        """Delete the spec of a pod that is gone; False (logged) on failure."""
        try:
            spec.path.unlink(missing_ok=True)
        except OSError as exc:
            self.logger.warning(
                "CDI spec not removed", file=str(spec.path), pod_uid=spec.pod_uid, error=str(exc)
            )
            return False
        self.metrics.cdi_specs_removed.inc()
        self.logger.info("removed the CDI spec of a pod gone", file=str(spec.path), pod_uid=spec.pod_uid)
        return True
