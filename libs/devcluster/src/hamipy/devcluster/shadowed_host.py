"""What a node's mount namespace puts over the host's: directories of the node's own over the
host directories it writes under, and files over the sysctls the kubelet sets at start (its writes
land in the files, never in the host's kernel). Shared by the kubelet over the fake runtime (its
own namespace) and by containerd (whose namespace the kubelet enters). A shadowed directory the
host lacks gets an empty mount point; the namespace dies with its last process, so nothing stays
mounted."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Final

__all__ = ["PROTECTED_SYSCTLS", "ShadowedHost"]

PROTECTED_SYSCTLS: Final = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
"""What the kubelet would set on the host; each is shadowed by a file holding the host's value."""


@dataclasses.dataclass(frozen=True)
class ShadowedHost:
    workdir: Path
    dirs: tuple[str, ...]
    """Host directories replaced by the node's own in its namespace."""

    def shadow(self, path: str) -> Path:
        """Where the namespace's ``path`` (under one of ``dirs``) lies on the host."""
        return self.workdir / "fs" / path.lstrip("/")

    def _sysctl_file(self, name: str) -> Path:
        return self.workdir / "sysctl" / name.replace("/", ".")

    def prepare(self) -> None:
        """Make the shadow directories, and the sysctl files holding the host's values."""
        for d in self.dirs:
            self.shadow(d).mkdir(parents=True, exist_ok=True)
        (self.workdir / "sysctl").mkdir(parents=True, exist_ok=True)
        for name in PROTECTED_SYSCTLS:
            self._sysctl_file(name).write_text(Path("/proc/sys", name).read_text())

    def mount_lines(self) -> list[str]:
        """The shell lines that put the shadows in place, run first in the new namespace."""
        # A directory the host lacks gets an empty mount point (mounts need one).
        lines = [f"mkdir -p {d}" for d in self.dirs if not Path(d).is_dir()]
        lines += [f"mount --bind {shlex.quote(str(self.shadow(d)))} {d}" for d in self.dirs]
        lines += [
            f"mount --bind {shlex.quote(str(self._sysctl_file(name)))} /proc/sys/{name}"
            for name in PROTECTED_SYSCTLS
        ]
        return lines
