"""What `make images` rebuilds (hamipy.devcluster.service_images): a service image's hash moves with
what goes into the image (its Dockerfile, .dockerignore, the files its COPY lines take, its base
images, its name) and with nothing else; the names are the Helm chart's; the official base images
are used only where a registry is reachable; the local bases' recipes, the slim trimming and the
archives' names as ``ctr images import`` reads them."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml

from hamipy.devcluster import base_images, images, oci_archive, service_images
from hamipy.devcluster.binaries import KUBERNETES_VERSION
from hamipy.devcluster.dockerfiles import DockerIgnore, context_files, copy_sources, declared_args
from hamipy.devcluster.errors import ImageBuildError
from hamipy.devcluster.service_images import Bases, ServiceBuild, chart_images, choose_bases, plan_service

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "deploy" / "helm" / "hami-py"
WEBHOOK_REF = "ghcr.io/hami-py/webhook:0.1.0"
LOCAL = Bases(
    build_args={"PYTHON_IMAGE": "localhost/hamipy-base/python:a", "GCC_IMAGE": "localhost/hamipy-base/gcc:a"},
    registry=None,
    local=None,
)
# Paths of the real repository, so they read as references to files that are there.
KEYS = "libs/protocol/src/hamipy/protocol/keys.py"
COMPILED = str(Path(KEYS).parent / "__pycache__" / "keys.cpython-311.pyc")
HOOKS = "native/src/hooks.c"
REPOSITORY_FILES = {
    "pyproject.toml": "[project]\nname = 'x'\n",
    "uv.lock": "version = 1\n",
    KEYS: "KEY = 1\n",
    COMPILED: "compiled",
    "services/webhook/src/hamipy/webhook/cli.py": "print('webhook')\n",
    HOOKS: "int hook;\n",
    "native/build/libvgpu.so": "built here",
    "docs/webhook.md": "# webhook\n",
    "README.md": "hami-py\n",
}


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A repository with the shipped Dockerfiles and .dockerignore and a few files of each kind."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "deploy" / "docker", root / "deploy" / "docker")
    shutil.copyfile(ROOT / ".dockerignore", root / ".dockerignore")
    for name, text in REPOSITORY_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def plan(
    root: Path, service: str = "webhook", *, bases: Bases = LOCAL, ref: str = WEBHOOK_REF
) -> ServiceBuild:
    return plan_service(root, service, ref, bases)


# -- what moves a service image's hash ---------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [KEYS, "services/webhook/src/hamipy/webhook/cli.py", "pyproject.toml", "uv.lock"],
)
def test_a_changed_file_the_dockerfile_copies_changes_the_hash(repository: Path, path: str) -> None:
    before = plan(repository).key
    (repository / path).write_text((repository / path).read_text() + "# changed\n")
    assert plan(repository).key != before


def test_a_new_file_the_dockerfile_copies_changes_the_hash(repository: Path) -> None:
    before = plan(repository).key
    (repository / KEYS).with_name("names.py").write_text("NAME = 1\n")
    assert plan(repository).key != before


def test_a_file_made_executable_changes_the_hash(repository: Path) -> None:
    before = plan(repository).key
    (repository / KEYS).chmod(0o755)
    assert plan(repository).key != before


@pytest.mark.parametrize(
    "path",
    [
        "docs/webhook.md",  # not copied
        "README.md",  # not copied
        "native/build/libvgpu.so",  # .dockerignore
        COMPILED,  # .dockerignore
        HOOKS,  # the webhook's Dockerfile does not copy native/
    ],
)
def test_a_file_the_image_does_not_take_leaves_the_hash(repository: Path, path: str) -> None:
    before = plan(repository).key
    (repository / path).write_text("changed")
    assert plan(repository).key == before


def test_the_interposers_source_changes_the_device_plugins_hash(repository: Path) -> None:
    before = plan(repository, "device-plugin").key
    (repository / HOOKS).write_text("int hook2;\n")
    assert plan(repository, "device-plugin").key != before


def test_touching_a_file_leaves_the_hash(repository: Path) -> None:
    before = plan(repository).key
    (repository / KEYS).touch()
    (repository / KEYS).write_text(REPOSITORY_FILES[KEYS])
    assert plan(repository).key == before


def test_the_dockerfile_and_dockerignore_change_the_hash(repository: Path) -> None:
    before = plan(repository).key
    dockerfile = repository / "deploy/docker/webhook.Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "LABEL x=y\n")
    after_dockerfile = plan(repository).key
    (repository / ".dockerignore").write_text((repository / ".dockerignore").read_text() + "README.md\n")
    assert len({before, after_dockerfile, plan(repository).key}) == 3


def test_the_name_changes_the_hash(repository: Path) -> None:
    assert plan(repository).key != plan(repository, ref="ghcr.io/hami-py/webhook:0.2.0").key


def test_only_the_build_arguments_a_dockerfile_declares_are_passed(repository: Path) -> None:
    assert plan(repository).build_args == {"PYTHON_IMAGE": "localhost/hamipy-base/python:a"}
    assert plan(repository, "device-plugin").build_args == LOCAL.build_args


def test_a_new_gcc_base_rebuilds_only_the_image_that_uses_it(repository: Path) -> None:
    new_gcc = Bases(
        build_args={**LOCAL.build_args, "GCC_IMAGE": "localhost/hamipy-base/gcc:b"}, registry=None, local=None
    )
    assert plan(repository, bases=new_gcc).key == plan(repository).key
    assert plan(repository, "device-plugin", bases=new_gcc).key != plan(repository, "device-plugin").key


def test_official_bases_hash_apart_from_local_ones(repository: Path) -> None:
    official = Bases(build_args={}, registry="docker.io", local=None)
    mirror = Bases(build_args={}, registry="mirror.example:5000", local=None)
    assert plan(repository, bases=official).build_args == {}
    assert (
        len({plan(repository).key, plan(repository, bases=official).key, plan(repository, bases=mirror).key})
        == 3
    )


def test_a_missing_dockerfile_is_named(repository: Path) -> None:
    with pytest.raises(ImageBuildError, match=r"nvidia\.Dockerfile is missing"):
        plan(repository, "nvidia")


# -- the build context ---------------------------------------------------------------------------------


def test_the_shipped_dockerfiles_copy_the_repository_parts_they_build_from() -> None:
    text = (ROOT / "deploy/docker/device-plugin.Dockerfile").read_text()
    assert set(copy_sources(text)) == {"native/", "pyproject.toml", "uv.lock", "libs/", "services/"}
    assert declared_args(text) == {"PYTHON_IMAGE", "GCC_IMAGE"}
    assert set(copy_sources((ROOT / "deploy/docker/webhook.Dockerfile").read_text())) == {
        "pyproject.toml",
        "uv.lock",
        "libs/",
        "services/",
    }


def test_dockerignore_reads_as_docker_reads_it() -> None:
    ignore = DockerIgnore("# comment\n.git\n**/__pycache__\nout/build\nnotes\n!notes/keep.md\n")
    assert ignore.excluded(".git/config")
    assert not ignore.excluded("pkg/.git")  # anchored at the context's root
    assert ignore.excluded("pkg/a/__pycache__/x.pyc")
    assert ignore.excluded("out/build/libvgpu.so")
    assert not ignore.excluded("out/src/build.c")
    assert ignore.excluded("notes/a.md")
    assert not ignore.excluded("notes/keep.md")  # the last matching rule wins


def test_a_copy_from_outside_the_context_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match="leaves the build context"):
        context_files(("../etc/",), tmp_path)


# -- the chart's names --------------------------------------------------------------------------------


def test_the_images_are_named_as_the_charts_default_values_name_them() -> None:
    names = chart_images(CHART)
    assert dict(names.services) == {
        "webhook": "ghcr.io/hami-py/webhook:0.1.0",
        "extender": "ghcr.io/hami-py/extender:0.1.0",
        "device-plugin": "ghcr.io/hami-py/device-plugin:0.1.0",
        "monitor": "ghcr.io/hami-py/monitor:0.1.0",
    }
    assert names.scheduler == f"registry.k8s.io/kube-scheduler:{KUBERNETES_VERSION}"


def chart_with(tmp_path: Path, **values: object) -> Path:
    chart = tmp_path / "chart"
    chart.mkdir()
    shutil.copyfile(CHART / "Chart.yaml", chart / "Chart.yaml")
    (chart / "values.yaml").write_text(yaml.safe_dump(values))
    return chart


def test_set_tags_and_registries_are_followed(tmp_path: Path) -> None:
    chart = chart_with(
        tmp_path,
        image={"registry": "registry.local:5000/gpu", "tag": "1.2.3"},
        scheduler={"image": {"repository": "registry.local:5000/kube-scheduler", "tag": "v1.33.1"}},
    )
    names = chart_images(chart)
    assert names.services["device-plugin"] == "registry.local:5000/gpu/device-plugin:1.2.3"
    assert names.scheduler == "registry.local:5000/kube-scheduler:v1.33.1"


def test_the_schedulers_first_form_a_string_is_used_as_it_is(tmp_path: Path) -> None:
    chart = chart_with(tmp_path, image={"registry": "r", "tag": ""}, scheduler={"image": "k8s/sched:v1"})
    assert chart_images(chart).scheduler == "k8s/sched:v1"


def test_values_without_an_image_section_are_named(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match=r"values\.yaml or Chart\.yaml lacks 'image'"):
        chart_images(chart_with(tmp_path, scheduler={}))


# -- which bases -------------------------------------------------------------------------------------


def test_a_named_registry_means_the_official_bases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_images, "docker_engine_answers", lambda: False)
    bases = choose_bases({service_images.BASE_REGISTRY_ENV: "mirror.example:5000"})
    assert (bases.build_args, bases.registry) == ({}, "mirror.example:5000")


def test_a_docker_engine_means_the_official_bases_from_docker_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_images, "docker_engine_answers", lambda: True)
    bases = choose_bases({})
    assert (bases.build_args, bases.registry) == ({}, "docker.io")


def test_without_a_registry_the_local_bases_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_images, "docker_engine_answers", lambda: False)
    bases = choose_bases({})
    assert bases.registry is None
    assert bases.local is not None
    assert bases.build_args == {"PYTHON_IMAGE": bases.local.python.ref, "GCC_IMAGE": bases.local.gcc.ref}


def test_a_local_base_is_named_by_its_recipe_and_the_machines_ca_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.crt"
    bundle.write_text("one CA\n")
    first = base_images.local_bases(bundle)
    assert first.python.ref.startswith("localhost/hamipy-base/python:3.11-bookworm-")
    assert first.gcc.ref.startswith("localhost/hamipy-base/gcc:12-bookworm-")
    assert f"FROM {first.python.ref}\n" in first.gcc.containerfile
    assert base_images.local_bases(bundle) == first
    bundle.write_text("one CA\nanother CA\n")
    second = base_images.local_bases(bundle)
    assert second.python.ref != first.python.ref
    assert second.gcc.ref != first.gcc.ref


def test_a_missing_ca_bundle_is_named(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match=r"ca\.crt is missing"):
        base_images.local_bases(tmp_path / "ca.crt")


# -- the slim base --------------------------------------------------------------------------------------


def test_slim_keeps_the_licences_and_never_follows_a_link(tmp_path: Path) -> None:
    rootfs, outside = tmp_path / "rootfs", tmp_path / "host"
    for name in ("usr/share/doc/pip/copyright", "usr/share/doc/pip/README", "usr/share/man/man1/pip.1.gz"):
        (rootfs / name).parent.mkdir(parents=True, exist_ok=True)
        (rootfs / name).write_text(name)
    (rootfs / "usr/bin").mkdir(parents=True)
    (rootfs / "usr/bin/python3").write_text("python")
    (outside / "doc").mkdir(parents=True)
    (outside / "doc/README").write_text("the host's")
    (rootfs / "usr/share/doc/linked").symlink_to(outside / "doc")
    base_images.slim(rootfs)
    left = sorted(p.relative_to(rootfs).as_posix() for p in rootfs.rglob("*") if not p.is_dir())
    assert left == ["usr/bin/python3", "usr/share/doc/pip/copyright"]
    assert (outside / "doc/README").read_text() == "the host's"
    assert "path-exclude /usr/share/man/*" in base_images.dpkg_filter()


# -- archives ------------------------------------------------------------------------------------------


def test_an_archive_named_by_its_oci_ref_name_only_is_read_as_ctr_imports_it(tmp_path: Path) -> None:
    """buildah's archives name the image in ``org.opencontainers.image.ref.name`` alone."""
    spec = oci_archive.ImageSpec(entries=(oci_archive.File("/x", b"x"),), entrypoint=("/x",), user="65532")
    path = tmp_path / "image.tar"
    path.write_bytes(oci_archive.layout_archive(oci_archive.image_blobs(spec), ("ghcr.io/hami-py/x:1",)))
    with tarfile.open(path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    index = json.loads(members["index.json"])
    for entry in index["manifests"]:
        del entry["annotations"][oci_archive.ANNOTATION_IMAGE_NAME]
        entry["annotations"][oci_archive.ANNOTATION_REF_NAME] = "ghcr.io/hami-py/x:1"
    members["index.json"] = json.dumps(index).encode()
    path.write_bytes(oci_archive.layer_tar([oci_archive.File(f"/{n}", d, 0o644) for n, d in members.items()]))
    summary = oci_archive.summarize_archive(path)
    assert summary.names == ("ghcr.io/hami-py/x:1",)
    assert summary.runtime["User"] == "65532"


def test_a_cached_archive_is_written_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAMIPY_CACHE_DIR", str(tmp_path / "cache"))
    writes: list[Path] = []

    def write(path: Path) -> None:
        writes.append(path)
        path.write_bytes(b"archive")

    first, built = images.cached_archive("webhook", "a" * 64, write)
    again, built_again = images.cached_archive("webhook", "a" * 64, write)
    assert (built, built_again, again, len(writes)) == (True, False, first, 1)
    assert first.read_bytes() == b"archive"
    assert writes[0] != first


def test_building_without_root_says_so(
    repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAMIPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ImageBuildError, match="needs root"):
        service_images._build_service(repository, plan(repository), LOCAL)
