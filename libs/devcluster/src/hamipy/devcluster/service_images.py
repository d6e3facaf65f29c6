"""The images the Helm chart runs, built here: the four services' from
``deploy/docker/<service>.Dockerfile`` as shipped, and the kube-scheduler of the chart's
hami-scheduler, each as an OCI image-layout archive that ``ctr -n k8s.io images import`` takes,
named as the chart's values name it (``chart_images``).

The Dockerfiles are built by buildah (``buildah``) from the repository root, as
``docker build -f deploy/docker/<service>.Dockerfile .`` builds them. Their base images are build
arguments: where a Docker engine answers (``docker info``) or ``HAMIPY_BASE_REGISTRY`` names a
registry, the Dockerfiles' defaults (the official images) are pulled, their short names looked up
in that registry (Docker Hub for an engine's); elsewhere the local stand-ins of ``base_images``
are passed in their place. kube-scheduler's image holds only the static binary the dev cluster
runs (``binaries.ensure_binaries``), at upstream's path, made like the dev cluster's pod images
(``oci_archive``).

Each archive lies under ``images.images_dir()``, named by a hash of what goes into it: for a service,
its Dockerfile, ``.dockerignore``, the files its ``COPY`` lines take from the repository (paths,
modes, contents; ``dockerfiles.context_digest``), its base images' names (a local base's name
holds its recipe's hash), the name it is given and this builder; for kube-scheduler, the binary.
An archive whose hash holds is reused without building anything, so a second run builds nothing
and a change rebuilds only the images it reaches. Builds hold the binaries' build lock.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import tomli_w
import yaml

from hamipy.devcluster import base_images, binaries, buildah, dockerfiles, images, oci_archive
from hamipy.devcluster.errors import DevClusterError, ImageBuildError
from hamipy.devcluster.host_packages import IMAGE_BUILD_PACKAGES, ensure_host_packages
from hamipy.devcluster.images import ImageArchive

__all__ = [
    "BASE_REGISTRY_ENV",
    "SERVICES",
    "Bases",
    "BuiltImage",
    "ChartImages",
    "ServiceBuild",
    "chart_images",
    "choose_bases",
    "ensure_service_images",
    "plan_service",
]

SERVICES: Final = ("webhook", "extender", "device-plugin", "monitor")
"""Each is ``deploy/docker/<name>.Dockerfile`` and the chart's component ``<name>``."""
DOCKER_DIR: Final = Path("deploy/docker")
CHART_DIR: Final = Path("deploy/helm/hami-py")
BASE_REGISTRY_ENV: Final = "HAMIPY_BASE_REGISTRY"
"""A registry (``docker.io``, or a mirror of it) the official base images are pulled from."""
ENGINE_REGISTRY: Final = "docker.io"
DOCKER_INFO_TIMEOUT_S: Final = 10.0
SCHEDULER_NAME: Final = "kube-scheduler"
SCHEDULER_BINARY: Final = "/usr/local/bin/kube-scheduler"
"""Where upstream's image has it; the chart's command is ``kube-scheduler``, found on PATH."""
SCHEDULER_USER: Final = "65532:65532"
"""Not root, whatever runs it: the chart runs it as 65532 too."""
IMAGE_PATH: Final = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)


@dataclasses.dataclass(frozen=True)
class ChartImages:
    services: Mapping[str, str]
    """Service -> the image the chart's default values name."""
    scheduler: str


def chart_images(chart: Path) -> ChartImages:
    """The images `chart`'s default values run: ``<image.registry>/<component>:<image.tag or
    appVersion>`` for the services; ``scheduler.image``, its empty tag being the cluster's version
    (the dev cluster's Kubernetes release)."""
    values = yaml.safe_load((chart / "values.yaml").read_text())
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    try:
        registry, tag = values["image"]["registry"], values["image"]["tag"] or meta["appVersion"]
        scheduler = values["scheduler"]["image"]
    except (KeyError, TypeError) as exc:
        raise ImageBuildError(f"{chart}: values.yaml or Chart.yaml lacks {exc}") from exc
    if not isinstance(scheduler, str):
        scheduler = f"{scheduler['repository']}:{scheduler['tag'] or binaries.KUBERNETES_VERSION}"
    return ChartImages(services={name: f"{registry}/{name}:{tag}" for name in SERVICES}, scheduler=scheduler)


@dataclasses.dataclass(frozen=True)
class Bases:
    """The base images the Dockerfiles are built on."""

    build_args: Mapping[str, str]
    """Build argument -> image; empty: the Dockerfiles' defaults (the official images)."""
    registry: str | None
    """Where the official images' short names are looked up; None: local bases."""
    local: base_images.LocalBases | None


def docker_engine_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        done = subprocess.run(
            [docker, "info"], capture_output=True, timeout=DOCKER_INFO_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def choose_bases(environ: Mapping[str, str] = os.environ) -> Bases:
    """The official images where a registry is named or a Docker engine answers, else local ones."""
    registry = environ.get(BASE_REGISTRY_ENV) or (ENGINE_REGISTRY if docker_engine_answers() else None)
    if registry:
        return Bases(build_args={}, registry=registry, local=None)
    local = base_images.local_bases()
    return Bases(
        build_args={"PYTHON_IMAGE": local.python.ref, "GCC_IMAGE": local.gcc.ref},
        registry=None,
        local=local,
    )


@dataclasses.dataclass(frozen=True)
class ServiceBuild:
    """What building one service's image takes, and the hash of it."""

    service: str
    ref: str
    dockerfile: Path
    build_args: Mapping[str, str]
    """Only those the Dockerfile declares."""
    key: str


def _builder_source() -> bytes:
    return Path(__file__).read_bytes() + Path(buildah.__file__).read_bytes()


def plan_service(root: Path, service: str, ref: str, bases: Bases) -> ServiceBuild:
    """The build of `service`'s image named `ref` from the repository at `root` (nothing is built)."""
    dockerfile = root / DOCKER_DIR / f"{service}.Dockerfile"
    if not dockerfile.is_file():
        raise ImageBuildError(f"{dockerfile} is missing")
    text = dockerfile.read_text()
    declared = dockerfiles.declared_args(text)
    build_args = {name: image for name, image in bases.build_args.items() if name in declared}
    ignore = root / ".dockerignore"
    key = images.digest_of(
        _builder_source(),
        ref.encode(),
        text.encode(),
        ignore.read_bytes() if ignore.is_file() else b"",
        dockerfiles.context_digest(dockerfiles.copy_sources(text), root).encode(),
        repr(sorted(build_args.items())).encode(),
        (bases.registry or "").encode(),
    )
    return ServiceBuild(service=service, ref=ref, dockerfile=dockerfile, build_args=build_args, key=key)


@dataclasses.dataclass(frozen=True)
class BuiltImage:
    image: ImageArchive
    build_s: float | None
    """Seconds this call took to build it; None: its archive was in the cache."""

    @property
    def size_bytes(self) -> int:
        return self.image.archive.stat().st_size


def _require_root() -> None:
    if os.geteuid() != 0:
        raise ImageBuildError(
            "building the service images needs root (buildah builds them here, debootstrap makes "
            "their local base images): run `make images` as root"
        )


def _registries_conf(registry: str) -> Path:
    """A registries.conf that looks short image names up in `registry` (only)."""
    path = buildah.storage_dir() / "registries.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        tomli_w.dumps({"unqualified-search-registries": [registry], "short-name-mode": "permissive"})
    )
    return path


def _build_service(root: Path, build: ServiceBuild, bases: Bases) -> BuiltImage:
    def write(archive: Path) -> None:
        _require_root()
        needed = IMAGE_BUILD_PACKAGES if bases.local is not None else IMAGE_BUILD_PACKAGES[:1]
        ensure_host_packages(needed, needed_by="building the service images")
        if bases.local is not None:
            local = bases.local.by_ref()
            for image in build.build_args.values():
                base_images.ensure_base(local[image])
        binaries._progress(f"building {build.ref} from {build.dockerfile.relative_to(root)}")
        buildah.build(
            containerfile=build.dockerfile,
            context=root,
            tag=build.ref,
            build_args=build.build_args,
            log=buildah.log_dir() / f"{build.service}.log",
            registries_conf=_registries_conf(bases.registry) if bases.registry else None,
        )
        buildah.push_archive(build.ref, archive)
        buildah.prune()  # the image this name had before

    began = time.monotonic()
    path, built = images.cached_archive(build.service, build.key, write)
    return BuiltImage(images.archive_of(path), time.monotonic() - began if built else None)


def scheduler_spec(binary: Path) -> oci_archive.ImageSpec:
    return oci_archive.ImageSpec(
        entries=(
            oci_archive.File(SCHEDULER_BINARY, binary.read_bytes()),
            oci_archive.Directory("/tmp", 0o1777),
        ),
        entrypoint=(SCHEDULER_BINARY,),
        env=IMAGE_PATH,
        user=SCHEDULER_USER,
        architecture=images._architecture(),
    )


def _build_scheduler(ref: str, binary: Path) -> BuiltImage:
    spec = scheduler_spec(binary)
    runtime = repr((spec.entrypoint, spec.env, spec.user, spec.architecture)).encode()
    key = images.digest_of(
        Path(__file__).read_bytes(),
        Path(oci_archive.__file__).read_bytes(),
        ref.encode(),
        oci_archive.layer_tar(spec.entries),
        runtime,
    )

    def write(archive: Path) -> None:
        archive.write_bytes(oci_archive.layout_archive(oci_archive.image_blobs(spec), (ref,)))

    began = time.monotonic()
    path, built = images.cached_archive(SCHEDULER_NAME, key, write)
    return BuiltImage(images.archive_of(path), time.monotonic() - began if built else None)


def ensure_service_images(root: Path, *, bases: Bases | None = None) -> tuple[BuiltImage, ...]:
    """The four service images and kube-scheduler's, built where their archive is missing or stale
    (`root`: the repository; `bases`: default ``choose_bases()``)."""
    root = root.resolve()
    chart = chart_images(root / CHART_DIR)
    bases = bases or choose_bases()
    plans = [plan_service(root, service, chart.services[service], bases) for service in SERVICES]
    scheduler_binary = binaries.ensure_binaries().kube_scheduler  # before the build lock: it may take it
    built = [_build_service(root, plan, bases) for plan in plans]
    return (*built, _build_scheduler(chart.scheduler, scheduler_binary))


def _size(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def report(built: Sequence[BuiltImage], total_s: float) -> str:
    """One line an image (name, archive size, archive, how long it took) and the total."""
    width = max(len(b.image.ref) for b in built)
    lines = [
        f"{b.image.ref:<{width}}  {_size(b.size_bytes):>10}  {b.image.archive}  "
        + (f"built in {b.build_s:.1f} s" if b.build_s is not None else "cached")
        for b in built
    ]
    fresh = sum(1 for b in built if b.build_s is not None)
    lines.append(f"{fresh} of {len(built)} images built, in {total_s:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hamipy.devcluster.service_images",
        description="Build (when stale) the service images and kube-scheduler's, and print their archives.",
    )
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository (default: .)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    try:
        built = ensure_service_images(args.root)
    except DevClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report(built, time.monotonic() - began))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
