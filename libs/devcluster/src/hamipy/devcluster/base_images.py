"""Local stand-ins for the official base images the Dockerfiles name, for machines that reach
Debian's package archive and PyPI but no container registry:

- python (``PYTHON_IMAGE``; the official ``python:3.11.14-slim-bookworm``): Debian bookworm as
  ``debootstrap --variant=minbase`` makes it, with Debian's Python 3.11 and pip, trimmed as
  Debian's slim images are (no manuals, docs or translations, now or in later installs).
- gcc (``GCC_IMAGE``; the official ``gcc:12.4.0-bookworm``): that image with Debian's gcc 12, make
  and the C library headers.

What the Dockerfiles' steps rely on holds in both: ``pip install`` installs into the system (the
externally-managed marker of PEP 668 is removed, as PEP 668 allows for a container image), ``uv``
finds the one ``python3`` on PATH, and HTTPS downloads trust the machine's CA bundle (it replaces
Debian's, since the package index may only be reachable through a proxy the machine trusts; and
``SSL_CERT_FILE`` names it for uv, which otherwise trusts only its own roots).

Each image's tag ends in a hash of its recipe (``localhost/hamipy-base/python:3.11-bookworm-<hash>``):
a changed recipe or CA bundle makes a new one, and the old one is untagged. debootstrap takes the
suite's current packages, so two machines' bases with one tag may differ in Debian's point
releases. Build them with the binaries' build lock held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from hamipy.devcluster import binaries, buildah
from hamipy.devcluster.errors import ImageBuildError
from hamipy.devcluster.images import digest_of

__all__ = ["BaseImage", "LocalBases", "ensure_base", "local_bases"]

SUITE: Final = "bookworm"
MIRROR: Final = "http://deb.debian.org/debian"
PYTHON_PACKAGES: Final = ("python3", "python3-pip")
GCC_PACKAGES: Final = ("gcc", "libc6-dev", "make")
HOST_CA_BUNDLE: Final = Path("/etc/ssl/certs/ca-certificates.crt")
IMAGE_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SLIM_EXCLUDES: Final = (
    "/usr/share/doc/*",
    "/usr/share/groff/*",
    "/usr/share/info/*",
    "/usr/share/linda/*",
    "/usr/share/lintian/overrides/*",
    "/usr/share/locale/*",
    "/usr/share/man/*",
)
SLIM_INCLUDES: Final = ("/usr/share/doc/*/copyright",)
"""Debian's slim images' dpkg filter (``/etc/dpkg/dpkg.cfg.d/docker`` in ``debian:bookworm-slim``):
the licences stay."""
EXTERNALLY_MANAGED: Final = "usr/lib/python3.11/EXTERNALLY-MANAGED"
DEBOOTSTRAP_TIMEOUT_S: Final = 1800.0
TAR_TIMEOUT_S: Final = 600.0


@dataclasses.dataclass(frozen=True)
class BaseImage:
    repository: str
    version: str
    """The tag's leading part, the versions it stands for."""
    containerfile: str
    """How it is made from its context (``rootfs.tar`` for the python base)."""
    key: str
    """The hash of its recipe."""
    parent: BaseImage | None = None
    """The image it is made from; None: made from a debootstrap root file system."""
    ca_bundle: Path = HOST_CA_BUNDLE
    """The machine's CA bundle the root file system takes."""

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.version}-{self.key[:16]}"


@dataclasses.dataclass(frozen=True)
class LocalBases:
    python: BaseImage
    gcc: BaseImage

    def by_ref(self) -> dict[str, BaseImage]:
        return {base.ref: base for base in (self.python, self.gcc)}


def dpkg_filter() -> str:
    """The dpkg configuration that keeps later installs slim too."""
    lines = [f"path-exclude {pattern}" for pattern in SLIM_EXCLUDES]
    lines += [f"path-include {pattern}" for pattern in SLIM_INCLUDES]
    return "\n".join(lines) + "\n"


def local_bases(ca_bundle: Path = HOST_CA_BUNDLE) -> LocalBases:
    """The two bases' names and recipes (nothing is built). `ca_bundle`: the machine's CA bundle."""
    if not ca_bundle.is_file():
        raise ImageBuildError(f"{ca_bundle} is missing: the base images take the machine's CA bundle")
    python_file = (
        "FROM scratch\n"
        "ADD rootfs.tar /\n"
        f"ENV PATH={IMAGE_PATH} LANG=C.UTF-8 SSL_CERT_FILE={HOST_CA_BUNDLE}\n"
        'CMD ["python3"]\n'
    )
    python_key = digest_of(
        repr((SUITE, MIRROR, PYTHON_PACKAGES, SLIM_EXCLUDES, SLIM_INCLUDES, EXTERNALLY_MANAGED)).encode(),
        python_file.encode(),
        ca_bundle.read_bytes(),
    )
    python = BaseImage(
        "localhost/hamipy-base/python", "3.11-bookworm", python_file, python_key, ca_bundle=ca_bundle
    )
    gcc_file = (
        f"FROM {python.ref}\n"
        "RUN apt-get update \\\n"
        " && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\\n"
        f"    {' '.join(GCC_PACKAGES)} \\\n"
        " && rm -rf /var/lib/apt/lists/*\n"
    )
    gcc = BaseImage(
        "localhost/hamipy-base/gcc",
        "12-bookworm",
        gcc_file,
        digest_of(python_key.encode(), gcc_file.encode()),
        parent=python,
        ca_bundle=ca_bundle,
    )
    return LocalBases(python=python, gcc=gcc)


def ensure_base(base: BaseImage) -> None:
    """`base` (and its parent) in buildah's storage, made if missing. Hold the build lock."""
    if base.parent is not None:
        ensure_base(base.parent)
    if buildah.image_exists(base.ref):
        return
    began = time.monotonic()
    binaries._progress(f"making the base image {base.ref} (once per recipe)")
    log = buildah.log_dir() / f"base-{base.repository.rsplit('/', 1)[-1]}.log"
    with _scratch() as work:
        context = work / "context"
        context.mkdir()
        if base.parent is None:
            _rootfs_archive(work / "rootfs", context / "rootfs.tar", base.ca_bundle)
        (context / "Containerfile").write_text(base.containerfile)
        buildah.build(
            containerfile=context / "Containerfile", context=context, tag=base.ref, build_args={}, log=log
        )
    buildah.remove_other_tags(base.repository, keep=base.ref)
    binaries._progress(f"made {base.ref} in {binaries._elapsed(began)}")


def _rootfs_archive(rootfs: Path, archive: Path, ca_bundle: Path) -> None:
    """debootstrap's root file system, made into the python base, as a tar at `archive`."""
    log = buildah.log_dir() / "debootstrap.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(PYTHON_PACKAGES)}",
        SUITE,
        str(rootfs),
        MIRROR,
    ]
    _logged(argv, log, timeout_s=DEBOOTSTRAP_TIMEOUT_S)
    slim(rootfs)
    (rootfs / "etc/dpkg/dpkg.cfg.d").mkdir(parents=True, exist_ok=True)
    (rootfs / "etc/dpkg/dpkg.cfg.d/docker").write_text(dpkg_filter())
    (rootfs / EXTERNALLY_MANAGED).unlink(missing_ok=True)
    certificates = rootfs / HOST_CA_BUNDLE.relative_to("/")
    certificates.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ca_bundle, certificates)
    # What the package manager downloaded and indexed (the official images keep neither).
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*"):
        for path in rootfs.glob(pattern):
            if path.is_file():
                path.unlink()
    _logged(
        ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(archive), "."], log, timeout_s=TAR_TIMEOUT_S
    )


def slim(rootfs: Path) -> None:
    """Remove from `rootfs` what ``SLIM_EXCLUDES`` filters out of later installs. Links are removed,
    never followed (an absolute one points into the host)."""
    for pattern in SLIM_EXCLUDES:
        top = rootfs / pattern.lstrip("/").removesuffix("/*")
        if top.is_symlink() or not top.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            here = Path(dirpath)
            for name in [*filenames, *(d for d in dirnames if (here / d).is_symlink())]:
                image_path = "/" + (here / name).relative_to(rootfs).as_posix()
                if not any(fnmatch.fnmatch(image_path, keep) for keep in SLIM_INCLUDES):
                    (here / name).unlink()


def _logged(argv: list[str], log: Path, *, timeout_s: float) -> None:
    with log.open("a") as out:
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ImageBuildError(f"{' '.join(argv)} failed: {exc} (log: {log})") from exc
    if done.returncode != 0:
        raise ImageBuildError(f"{' '.join(argv)} exited {done.returncode} (log: {log})")


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    """A working directory beside buildah's storage (one file system, room for a root file system),
    removed afterwards, once whatever debootstrap left mounted in it is unmounted: a killed
    debootstrap leaves the target's /proc and /sys mounted, and removing through them would reach
    the host's."""
    buildah.storage_dir().mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="base-", dir=buildah.storage_dir()))
    try:
        yield path
    finally:
        for mount in sorted(_mounts_below(path), reverse=True):
            subprocess.run(["umount", "--lazy", mount], capture_output=True, timeout=60, check=False)
        if _mounts_below(path):
            raise ImageBuildError(f"{path} still has mounts below it: unmount them, then remove it")
        shutil.rmtree(path)


def _mounts_below(path: Path) -> list[str]:
    """Mount points at or below `path` (from /proc/self/mountinfo)."""
    top = os.path.realpath(path)
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == top or point.startswith(top + "/"):
            found.append(point)
    return found
