"""Debian packages the real-runtime nodes run (runc, the CNI plugins, the workload image's busybox)
and the service images are built with (buildah, debootstrap): found on the host, or installed from
Debian's archive when running as root, the way the Kubernetes binaries are built on first use."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from hamipy.devcluster.errors import DevClusterError

__all__ = [
    "IMAGE_BUILD_PACKAGES",
    "RUNTIME_PACKAGES",
    "HostPackage",
    "ensure_host_packages",
    "missing_packages",
]

APT_TIMEOUT_S: Final = 900.0


@dataclasses.dataclass(frozen=True)
class HostPackage:
    package: str
    """The Debian package that provides ``path``."""
    path: Path


RUNTIME_PACKAGES: Final = (
    HostPackage("runc", Path("/usr/sbin/runc")),
    HostPackage("containernetworking-plugins", Path("/usr/lib/cni/bridge")),
    HostPackage("iproute2", Path("/usr/sbin/ip")),
    HostPackage("busybox-static", Path("/bin/busybox")),
)
IMAGE_BUILD_PACKAGES: Final = (
    HostPackage("buildah", Path("/usr/bin/buildah")),
    HostPackage("debootstrap", Path("/usr/sbin/debootstrap")),
)
"""What ``service_images`` builds the Dockerfiles with, and makes the local base images with."""


def missing_packages(packages: Sequence[HostPackage] = RUNTIME_PACKAGES) -> list[HostPackage]:
    return [p for p in packages if not p.path.exists()]


def _apt(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        ["apt-get", *args], capture_output=True, text=True, env=env, timeout=APT_TIMEOUT_S, check=False
    )


def ensure_host_packages(
    packages: Sequence[HostPackage] = RUNTIME_PACKAGES, *, needed_by: str = "the real-runtime nodes"
) -> None:
    """Install the missing ``packages`` with apt-get (root only); DevClusterError naming them, and
    `needed_by` (what needs them), when that cannot be done here."""
    missing = missing_packages(packages)
    if not missing:
        return
    names = sorted({p.package for p in missing})
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DevClusterError(
            f"{needed_by} need the Debian packages {', '.join(names)} "
            f"(missing: {', '.join(str(p.path) for p in missing)}); install them as root: "
            f"apt-get install -y {' '.join(names)}"
        )
    install = ["install", "-y", "--no-install-recommends", *names]
    done = _apt(install)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        _apt(["update"])
        done = _apt(install)
    still = missing_packages(packages)
    if done.returncode != 0 or still:
        raise DevClusterError(
            f"apt-get {' '.join(install)} failed (exit {done.returncode}); still missing "
            f"{', '.join(str(p.path) for p in still) or 'nothing'}:\n{done.stderr[-2000:]}"
        )
