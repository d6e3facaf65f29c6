"""buildah, which builds the service images from their Dockerfiles without a Docker daemon, with
its image store and network configuration under the cache root (``storage_dir()``), not the
host's defaults: the images it holds are this project's build state, kept and pruned with the
archives made from them.

Every command runs as root (``service_images`` says so before the first); RUN steps and ``run``
use chroot isolation (``ISOLATION``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

import tomli_w

from hamipy.devcluster import binaries
from hamipy.devcluster.errors import ImageBuildError

__all__ = [
    "ISOLATION",
    "build",
    "buildah",
    "image_exists",
    "log_dir",
    "prune",
    "push_archive",
    "remove_other_tags",
    "run_in_archive",
    "storage_dir",
]

ISOLATION: Final = "chroot"
"""How RUN steps (and ``run_in_archive``) run: in a chroot of the image's root file system, in the
host's network, without an OCI runtime. buildah's default, ``oci``, runs each step in runc with a
network namespace wired by CNI, which makes a bridge (``cni-podman0``) and firewall chains on the
host and a cgroup per step (cgroup v1 here, and root without CAP_SYS_RESOURCE); none of that is
wanted to run ``pip install`` and ``make``. The steps only need the network to download from PyPI
and Debian's archive."""
BUILD_TIMEOUT_S: Final = 1800.0
"""One ``buildah bud``: a cold one downloads uv and the locked wheels, or the Debian packages."""
COMMAND_TIMEOUT_S: Final = 600.0
"""Anything else: a push writes a few hundred MB, a run starts one process."""
OUTPUT_TAIL_LINES: Final = 40


def storage_dir() -> Path:
    return binaries.cache_root() / "buildah"


def log_dir() -> Path:
    return storage_dir() / "logs"


def _argv(args: tuple[str, ...]) -> list[str]:
    top = storage_dir()
    return ["buildah", "--root", str(top / "storage"), "--runroot", str(top / "run"), *args]


def _containers_conf() -> Path:
    """A containers.conf that keeps buildah's network configuration directory (where it makes a
    CNI lock even for chroot isolation) under ``storage_dir()`` rather than ``/etc/cni``."""
    path = storage_dir() / "containers.conf"
    text = tomli_w.dumps({"network": {"network_config_dir": str(storage_dir() / "cni")}})
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{os.getpid()}")
        staged.write_text(text)
        staged.replace(path)
    return path


def _environ(registries_conf: Path | None) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("LD_")}
    env["CONTAINERS_CONF"] = str(_containers_conf())
    if registries_conf is not None:
        env["CONTAINERS_REGISTRIES_CONF"] = str(registries_conf)
    return env


def buildah(*args: str, timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    """``buildah ARGS`` on our storage; its output, or ImageBuildError with it (`check`)."""
    try:
        done = subprocess.run(
            _argv(args), env=_environ(None), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageBuildError(f"buildah {' '.join(args)} failed: {exc}") from exc
    if check and done.returncode != 0:
        raise ImageBuildError(f"buildah {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout


def build(
    *,
    containerfile: Path,
    context: Path,
    tag: str,
    build_args: Mapping[str, str],
    log: Path,
    registries_conf: Path | None = None,
) -> None:
    """``buildah bud`` of `containerfile` in `context`, tagged `tag`; its output goes to `log`.
    `registries_conf`: where short image names are looked up (default: the host's configuration)."""
    args = ["bud", "--isolation", ISOLATION, "-f", str(containerfile), "-t", tag]
    for name, value in sorted(build_args.items()):
        args += ["--build-arg", f"{name}={value}"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            done = subprocess.run(
                [*_argv((*args, str(context)))],
                env=_environ(registries_conf),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ImageBuildError(f"building {tag} ran past {BUILD_TIMEOUT_S:g} s (log: {log})") from exc
    if done.returncode != 0:
        with log.open() as text:
            tail = "".join(collections.deque(text, maxlen=OUTPUT_TAIL_LINES))
        raise ImageBuildError(f"building {tag} from {containerfile} failed (log: {log}):\n{tail}")


def push_archive(image: str, path: Path) -> None:
    """`image` as an OCI image-layout archive at `path`, its index naming it `image` (what ``ctr
    images import`` names it)."""
    buildah("push", image, f"oci-archive:{path}:{image}")


def image_exists(image: str) -> bool:
    done = subprocess.run(
        _argv(("inspect", "--type", "image", image)),
        env=_environ(None),
        capture_output=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    return done.returncode == 0


def remove_other_tags(repository: str, *, keep: str) -> None:
    """Untag every image of `repository` but `keep` (``prune`` then removes what nothing uses)."""
    listing = buildah("images", "--json")
    for image in json.loads(listing or "[]"):
        for name in image.get("names") or ():
            if name.rsplit(":", 1)[0] == repository and name != keep:
                buildah("rmi", name, check=False)


def prune() -> None:
    """Remove the images no name and no container uses (earlier builds of a name built again)."""
    buildah("rmi", "--prune", check=False)


@contextlib.contextmanager
def _container_of(archive: Path) -> Iterator[str]:
    name = f"hamipy-check-{uuid.uuid4().hex[:12]}"
    buildah("from", "--name", name, "--pull-always", f"oci-archive:{archive}")
    try:
        yield name
    finally:
        buildah("rm", name, check=False)


def run_in_archive(
    archive: Path, argv: list[str], *, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run `argv` in a container of the image in `archive`, as its config says (user, env, working
    directory): what ``docker run --entrypoint argv[0] IMAGE argv[1:]`` would run."""
    with _container_of(archive) as container:
        try:
            return subprocess.run(
                _argv(("run", "--isolation", ISOLATION, container, "--", *argv)),
                env=_environ(None),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ImageBuildError(f"{' '.join(argv)} in {archive} ran past {timeout_s:g} s") from exc
