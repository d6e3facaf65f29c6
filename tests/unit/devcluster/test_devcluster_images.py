"""The dev cluster's image archives (hamipy.devcluster.images): valid OCI layouts that name their
images for ``ctr images import``, the same bytes every time, holding what the pods need, cached
by their inputs."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from hamipy.devcluster import images, oci_archive
from hamipy.devcluster.errors import ImageBuildError
from hamipy.devcluster.images import GPU_WORKLOAD_IMAGE, PAUSE_IMAGE, ImageArchive

ROOT = Path(__file__).resolve().parents[3]
NATIVE = ROOT / "native"
NATIVE_FILES = ("gpu-workload", "libvgpu.so", "fake/libcuda.so.1")

# Building native/ from scratch takes longer than a unit test's 30 s on a loaded machine.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def native_build() -> Path:
    """native/build with the files the workload image takes, built (incrementally) by make."""
    proc = subprocess.run(
        ["make", "-C", str(NATIVE), *(f"build/{name}" for name in NATIVE_FILES)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"make -C native failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return NATIVE / "build"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("HAMIPY_CACHE_DIR", str(root))
    return root


def copy_of(native_build: Path, to: Path) -> Path:
    """The workload image's inputs from `native_build`, copied into `to` (for tests that change one)."""
    for name in NATIVE_FILES:
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(native_build / name, to / name)
    return to


def build(which: str, native_build: Path) -> ImageArchive:
    return images.ensure_pause_image() if which == "pause" else images.ensure_workload_image(native_build)


class Layout:
    """An image-layout archive read with nothing of the code under test."""

    def __init__(self, path: Path) -> None:
        with tarfile.open(path) as tar:
            self.files = {
                member.name: handle.read()
                for member in tar.getmembers()
                if member.isfile() and (handle := tar.extractfile(member)) is not None
            }

    def json(self, name: str) -> Any:
        return json.loads(self.files[name])

    def blob(self, descriptor: dict[str, Any]) -> bytes:
        algorithm, hexdigest = descriptor["digest"].split(":")
        data = self.files[f"blobs/{algorithm}/{hexdigest}"]
        assert len(data) == descriptor["size"]
        return data

    @property
    def manifest(self) -> Any:
        first, *_ = self.json("index.json")["manifests"]  # every entry names the same manifest
        return json.loads(self.blob(first))

    @property
    def config(self) -> Any:
        return json.loads(self.blob(self.manifest["config"]))

    def layer(self) -> dict[str, tuple[tarfile.TarInfo, bytes]]:
        (descriptor,) = self.manifest["layers"]
        members: dict[str, tuple[tarfile.TarInfo, bytes]] = {}
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(self.blob(descriptor)))) as tar:
            for member in tar.getmembers():
                handle = tar.extractfile(member) if member.isfile() else None
                members[member.name] = (member, handle.read() if handle is not None else b"")
        return members


@pytest.mark.parametrize("which", ["pause", "gpu-workload"])
def test_the_archive_is_a_valid_oci_layout(which: str, native_build: Path) -> None:
    image = build(which, native_build)
    layout = Layout(image.archive)

    assert layout.json("oci-layout") == {"imageLayoutVersion": "1.0.0"}
    assert {name for name in layout.files if not name.startswith("blobs/")} == {"oci-layout", "index.json"}
    for name, data in layout.files.items():
        if name.startswith("blobs/"):
            assert name == "blobs/sha256/" + hashlib.sha256(data).hexdigest()
    index = layout.json("index.json")
    assert index["schemaVersion"] == 2
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    names = [entry["annotations"]["io.containerd.image.name"] for entry in index["manifests"]]
    assert names == [image.ref, *image.aliases]
    for entry in index["manifests"]:
        assert entry["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
        assert entry["digest"] == image.manifest_digest
        tag = entry["annotations"]["io.containerd.image.name"].rsplit(":", 1)[1]
        assert entry["annotations"]["org.opencontainers.image.ref.name"] == tag
        assert entry["platform"] == {"architecture": layout.config["architecture"], "os": "linux"}
        layout.blob(entry)  # its size is right

    manifest = layout.manifest
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert manifest["config"]["digest"] == image.config_digest
    config = layout.config
    diff_ids = [
        "sha256:" + hashlib.sha256(gzip.decompress(layout.blob(layer))).hexdigest()
        for layer in manifest["layers"]
    ]
    assert config["rootfs"] == {"type": "layers", "diff_ids": diff_ids}
    assert [layer["mediaType"] for layer in manifest["layers"]] == [
        "application/vnd.oci.image.layer.v1.tar+gzip"
    ]


@pytest.mark.parametrize("which", ["pause", "gpu-workload"])
def test_building_twice_gives_the_same_bytes(
    which: str, native_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build(which, native_build)
    monkeypatch.setenv("HAMIPY_CACHE_DIR", str(tmp_path / "another-cache"))
    second = build(which, native_build)
    assert second.archive != first.archive
    assert second.archive.read_bytes() == first.archive.read_bytes()


def image_path(members: dict[str, tuple[tarfile.TarInfo, bytes]], path: str) -> str:
    """The member that `path` (absolute, in the image) is, following the image's symlinks."""
    resolved = PurePosixPath()
    for part in PurePosixPath(path).relative_to("/").parts:
        resolved /= part
        member, _ = members[str(resolved)]
        while member.issym():
            resolved = resolved.parent / member.linkname
            member, _ = members[str(resolved)]
    return str(resolved)


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def test_the_workload_layer_holds_the_program_its_loader_and_libraries_and_busybox(
    native_build: Path,
) -> None:
    image = images.ensure_workload_image(native_build)
    layout = Layout(image.archive)
    members = layout.layer()

    program = native_build / "gpu-workload"
    assert layout.config["config"]["Entrypoint"] == ["/usr/local/bin/gpu-workload"]
    assert members[image_path(members, "/usr/local/bin/gpu-workload")][1] == program.read_bytes()
    interpreter = readelf("-l", str(program)).split("[Requesting program interpreter: ")[1].split("]")[0]
    assert members[image_path(members, interpreter)][1] == Path(interpreter).read_bytes()
    multiarch = subprocess.run(
        ["gcc", "-print-multiarch"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    for elf in (program, native_build / "libvgpu.so", native_build / "fake/libcuda.so.1"):
        for needed in readelf("-d", str(elf)).split("Shared library: [")[1:]:
            soname = needed.split("]")[0]
            if soname not in ("libcuda.so.1", PurePosixPath(interpreter).name):
                # The loader finds it in its default directory (there is no ld.so.cache).
                assert members[image_path(members, f"/lib/{multiarch}/{soname}")][0].isfile(), soname
    assert not [name for name in members if "libcuda" in name or "libnvidia-ml" in name]

    busybox = members[image_path(members, "/bin/busybox")]
    assert busybox[1] == images.BUSYBOX.read_bytes()
    for applet in ("sh", "ls", "cat", "env", "sleep"):
        assert image_path(members, f"/bin/{applet}") == image_path(members, "/bin/busybox")
    assert members["tmp"][0].mode == 0o1777
    assert members["etc/passwd"][1].startswith(b"root:x:0:0:")
    assert image.ref == f"hamipy.local/gpu-workload:{image.manifest_digest.removeprefix('sha256:')[:12]}"
    assert image.aliases == (GPU_WORKLOAD_IMAGE,)


def test_the_pause_layer_holds_a_static_pause(tmp_path: Path) -> None:
    image = images.ensure_pause_image()
    layout = Layout(image.archive)
    members = layout.layer()

    assert image.ref == PAUSE_IMAGE == "registry.k8s.io/pause:3.10.1"
    assert list(members) == ["pause"]
    member, data = members["pause"]
    assert member.mode == 0o755
    assert layout.config["config"]["Entrypoint"] == ["/pause"]
    assert layout.config["config"]["User"] == "65535:65535"
    pause = tmp_path / "pause"
    pause.write_bytes(data)
    pause.chmod(0o755)
    assert "INTERP" not in readelf("-l", str(pause))
    version = subprocess.run([str(pause), "-v"], capture_output=True, text=True, timeout=30, check=True)
    assert version.stdout == "pause.c v3.10.1-hamipy\n"


@pytest.mark.parametrize("which", ["pause", "gpu-workload"])
def test_a_second_call_builds_nothing(which: str, native_build: Path, cache: Path) -> None:
    first = build(which, native_build)
    listing, inode = sorted(os.listdir(first.archive.parent)), first.archive.stat().st_ino
    second = build(which, native_build)
    assert second == first
    assert second.archive.stat().st_ino == inode
    assert sorted(os.listdir(first.archive.parent)) == listing


def test_a_changed_program_gives_a_new_image(native_build: Path, tmp_path: Path) -> None:
    inputs = copy_of(native_build, tmp_path / "build")
    first = images.ensure_workload_image(inputs)
    with (inputs / "gpu-workload").open("ab") as program:
        program.write(b"\0")
    second = images.ensure_workload_image(inputs)
    assert second.archive != first.archive
    assert first.archive.is_file()  # another checkout may still use it
    assert second.manifest_digest != first.manifest_digest
    assert second.ref != first.ref
    assert second.aliases == first.aliases == (GPU_WORKLOAD_IMAGE,)


def test_a_changed_pause_source_is_built_again(tmp_path: Path) -> None:
    source = tmp_path / "pause.c"
    source.write_bytes(images.pause_source().read_bytes())
    first = images.ensure_pause_image(source)
    source.write_bytes(source.read_bytes() + b"/* changed */\n")
    second = images.ensure_pause_image(source)
    assert second.archive != first.archive
    assert second.ref == first.ref == PAUSE_IMAGE


def test_only_the_most_recently_used_archives_are_kept(native_build: Path, cache: Path) -> None:
    directory = cache / "images"
    directory.mkdir(parents=True)
    for n in range(images.KEEP_PER_IMAGE + 2):
        stale = directory / f"gpu-workload-{n:032x}.tar"
        stale.write_bytes(b"")
        os.utime(stale, (n, n))
    (directory / "pause-0.tar").write_bytes(b"")  # another image's: not counted
    image = images.ensure_workload_image(native_build)
    kept = sorted(path.name for path in directory.glob("gpu-workload-*.tar"))
    newest = [f"gpu-workload-{n:032x}.tar" for n in range(images.KEEP_PER_IMAGE + 2)][
        -(images.KEEP_PER_IMAGE - 1) :
    ]
    assert kept == sorted([image.archive.name, *newest])
    assert (directory / "pause-0.tar").exists()


def test_a_missing_busybox_names_its_package(native_build: Path, tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match="busybox-static"):
        images.ensure_workload_image(native_build, busybox=tmp_path / "busybox")


def test_a_dynamic_busybox_names_the_static_package(native_build: Path) -> None:
    with pytest.raises(
        ImageBuildError, match="dynamically linked: install the Debian package busybox-static"
    ):
        images.ensure_workload_image(native_build, busybox=native_build / "gpu-workload")


def test_a_missing_program_says_to_build_native(tmp_path: Path) -> None:
    with pytest.raises(
        ImageBuildError, match=r"gpu-workload is missing: build native/ first \(make -C native\)"
    ):
        images.ensure_workload_image(tmp_path)


def test_an_entry_below_a_symlink_is_refused() -> None:
    entries = (oci_archive.Symlink("/bin", "usr/bin"), oci_archive.File("/bin/sh", b""))
    with pytest.raises(ValueError, match="/bin holds /bin/sh but is not a directory"):
        oci_archive.layer_tar(entries)


@pytest.mark.parametrize("path", ["relative", "/", "/a/../../etc"], ids=["relative", "root", "dot-dot"])
def test_an_entry_outside_the_image_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="image path must be absolute"):
        oci_archive.layer_tar([oci_archive.File(path, b"")])


@pytest.mark.parametrize("name", ["hamipy.local/gpu-workload", "localhost:5000/x", "a/b:1@sha256:00"])
def test_a_name_without_a_tag_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="must end in a tag"):
        oci_archive.tag_of(name)
