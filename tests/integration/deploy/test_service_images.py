"""The images `make images` builds (``hamipy.devcluster.service_images``): the four services' from
``deploy/docker/*.Dockerfile`` as shipped, and the kube-scheduler the chart's hami-scheduler runs.
Each archive's image, run as its config says (user, environment, entrypoint), answers
``--version`` as the user its Dockerfile names, and a real containerd imports the archives under
the names the chart's values give them.

The first run on a machine builds everything (about 3 minutes on 2 cores); later runs reuse the
cached archives while nothing they are built from changes."""

from __future__ import annotations

import os
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from hamipy.devcluster import buildah, dockerfiles, oci_archive
from hamipy.devcluster.binaries import KUBERNETES_VERSION
from hamipy.devcluster.containerd_runtime import ContainerdRuntime
from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.service_images import (
    CHART_DIR,
    DOCKER_DIR,
    SCHEDULER_USER,
    SERVICES,
    BuiltImage,
    chart_images,
    ensure_service_images,
)

ROOT = Path(__file__).resolve().parents[3]
BUILD_TIMEOUT_S = 1800
"""A cold build: debootstrap, the gcc layer, four Dockerfiles (downloads included)."""

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(BUILD_TIMEOUT_S),
    pytest.mark.skipif(
        os.geteuid() != 0, reason="skipped: building the images needs root (buildah and debootstrap)"
    ),
]


@pytest.fixture(scope="module")
def built() -> dict[str, BuiltImage]:
    """Every image, by the name the chart gives it (built now, or found in the cache)."""
    try:
        images = ensure_service_images(ROOT)
    except DevClusterError as exc:
        pytest.fail(f"building the images failed: {exc}", pytrace=False)
    for image in images:
        how = f"built in {image.build_s:.1f} s" if image.build_s is not None else "cached"
        print(f"[images] {image.image.ref}: {image.size_bytes / 2**20:.1f} MiB, {how}")
    return {image.image.ref: image for image in images}


def service_version(service: str) -> str:
    return str(
        tomllib.loads((ROOT / "services" / service / "pyproject.toml").read_text())["project"]["version"]
    )


def dockerfile_user(service: str) -> str:
    """The last USER of the Dockerfile ("": none, root)."""
    text = (ROOT / DOCKER_DIR / f"{service}.Dockerfile").read_text()
    users = [args for keyword, args in dockerfiles.instructions(text) if keyword == "USER"]
    return users[-1] if users else ""


def run(archive: Path, argv: list[str]) -> str:
    done = buildah.run_in_archive(archive, argv)
    assert done.returncode == 0, f"{shlex.join(argv)} in {archive}: exit {done.returncode}\n{done.stderr}"
    return done.stdout.strip()


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_image_answers_version_as_its_dockerfiles_user(
    service: str, built: dict[str, BuiltImage]
) -> None:
    ref = chart_images(ROOT / CHART_DIR).services[service]
    archive = built[ref].image.archive
    config = oci_archive.summarize_archive(archive).runtime
    user = dockerfile_user(service)
    assert config.get("User", "") == user
    # As `docker run IMAGE --version` runs it: the entrypoint, its CMD replaced.
    assert (
        run(archive, [*config["Entrypoint"], "--version"]) == f"hamipy-{service} {service_version(service)}"
    )
    assert run(archive, ["id", "-u"]) == (user or "0")


def test_the_kube_scheduler_image_runs_the_clusters_release_as_non_root(built: dict[str, BuiltImage]) -> None:
    ref = chart_images(ROOT / CHART_DIR).scheduler
    assert ref == f"registry.k8s.io/kube-scheduler:{KUBERNETES_VERSION}"
    archive = built[ref].image.archive
    assert oci_archive.summarize_archive(archive).runtime["User"] == SCHEDULER_USER
    # The chart's command is the bare name: found on the image's PATH.
    assert run(archive, ["kube-scheduler", "--version"]) == f"Kubernetes {KUBERNETES_VERSION}"


@pytest.fixture
def containerd(built: dict[str, BuiltImage], tmp_path: Path) -> Iterator[ContainerdRuntime]:
    runtime = ContainerdRuntime(
        tmp_path / "node", node="images", image_archives=[image.image.archive for image in built.values()]
    )
    try:
        runtime.start()
        yield runtime
    finally:
        runtime.stop()


def test_containerd_imports_the_archives_under_the_charts_names(
    containerd: ContainerdRuntime, built: dict[str, BuiltImage]
) -> None:
    chart = chart_images(ROOT / CHART_DIR)
    listed = set(containerd.ctr("images", "ls", "--quiet").split())
    assert {*chart.services.values(), chart.scheduler} <= listed
    assert set(built) == {*chart.services.values(), chart.scheduler}
